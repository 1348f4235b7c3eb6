"""Block drafters (design §5b–§5e): one backbone pass drafts a whole block of positions.

    config.py      `BlockConfig` (DSpark; DFlash = `markov_rank=0`; ReaDy, DPara, TreeFlash head)
    network.py     the shared backbone and its read-outs (`BlockHead`, `train_logits`, the Markov,
                   confidence and TreeFlash heads)
    drafter.py     `BlockDrafter`: DSpark / DFlash behind the drafter contract, confidence cuts
    ready.py       ReaDy's network: the reader of a hybrid target's committed recurrent state
    ready_drafter.py  `ReadyDrafter`: ReaDy behind the contract (a BlockDrafter subclass)
    dpara.py       `DParaDrafter`: the next block drafted beside the verification, per acceptance boundary
    best_first.py  DDTree / TreeFlash tables and TAPS selection (functions of the drafter)
    checkpoint.py  `save_block_head` / `load_block_head`

The training objective and the confidence calibration are in `train/block.py` and
`train/calibration.py`; the verify-width rule the scheduler shares is in `specjax.spec.widths`.
"""
from specjax.drafters.block.checkpoint import (
                                            backbone_dir,
                                            check_backbone,
                                            load_block_head,
                                            read_config,
                                            save_block_head,
)
from specjax.drafters.block.config import BlockConfig, check_confidence, parse_confidence
from specjax.drafters.block.drafter import BlockDrafter
from specjax.drafters.block.dpara import DParaDrafter
from specjax.drafters.block.ready_drafter import ReadyDrafter
from specjax.drafters.block.network import (
                                            BlockHead,
                                            BlockPass,
                                            BlockState,
                                            TrainPass,
                                            ar_logits,
                                            base_logits,
                                            markov_embed,
                                            position_logits,
                                            row_logits,
                                            self_fed_walk,
                                            target_features,
                                            train_logits,
)
from specjax.drafters.block.ready import check_state_target

__all__ = ["BlockConfig", "BlockDrafter", "BlockHead", "DParaDrafter", "ReadyDrafter", "BlockPass", "BlockState", "TrainPass", "ar_logits",
           "backbone_dir", "base_logits", "check_backbone", "check_confidence", "check_state_target",
           "load_block_head", "markov_embed", "parse_confidence", "position_logits", "read_config", "row_logits",
           "save_block_head", "self_fed_walk", "target_features", "train_logits"]
