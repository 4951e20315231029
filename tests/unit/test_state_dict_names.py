"""Every placement keeps the state_dict of the code before the one-model refactor (issue 20): the same
keys, shapes, dtypes and order, so checkpoints, HF interop, layout-changing resume and ZeRO-1's
parameter order are unchanged. `data/state_dict_keys.json` was written by that code (the whole
model, an EP rank, and pipeline ranks of loop and V placements, built by its `DeepSeekV3` and
`StageModel`); the placements here are built by today's single model class."""
import json
from pathlib import Path

import pytest

from model.args import ModelArgs
from model.dispatcher import LocalDispatcher
from model.transformer import DeepSeekV3
from parallel.pipeline.stage import build_stages, stage_specs
from parallel.pipeline.wgrad import WeightGradStore

REFERENCE = json.loads((Path(__file__).parent / "data" / "state_dict_keys.json").read_text())["placements"]
ARGS, NO_MTP = ModelArgs(), ModelArgs(mtp_num_layers=0)


class SecondHalf(LocalDispatcher):
    """Owns experts [E/2, E), as EP rank 1 of 2 (only local_experts matters for the names)."""

    def local_experts(self, num_experts):
        return range(num_experts // 2, num_experts)


def rank_model(args, layout, num_stages, stage_ids, dispatcher=None):
    return build_stages(args, stage_specs(args, num_stages, layout), stage_ids, WeightGradStore(), dispatcher)[0]


PLACEMENTS = {
    "full": lambda: DeepSeekV3(ARGS),
    "full/ep2-rank1": lambda: DeepSeekV3(ARGS, SecondHalf()),
    "full/no-mtp": lambda: DeepSeekV3(NO_MTP),
    **{f"Et|t|t|tmL/stages{','.join(map(str, ids))}": (lambda ids=ids: rank_model(ARGS, "Et|t|t|tmL", 4, ids))
       for ids in [(0,), (1,), (2,), (3,), (0, 3), (1, 2)]},
    "Et|t|t|tmL/stages3/ep2-rank1": lambda: rank_model(ARGS, "Et|t|t|tmL", 4, (3,), SecondHalf()),
    "no-mtp/pp2/stages0": lambda: rank_model(NO_MTP, None, 2, (0,)),
    "no-mtp/pp2/stages1": lambda: rank_model(NO_MTP, None, 2, (1,)),
}


def test_every_reference_placement_is_built_here():
    assert PLACEMENTS.keys() == REFERENCE.keys()


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_state_dict_keys_shapes_and_order_are_unchanged(placement):
    model = PLACEMENTS[placement]()
    got = [f"{name} {'x'.join(map(str, t.shape))} {str(t.dtype).removeprefix('torch.')}"
           for name, t in model.state_dict().items()]
    assert got == REFERENCE[placement]
