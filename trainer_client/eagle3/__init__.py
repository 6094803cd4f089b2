"""Eagle-3 online training: the generic trainer (``trainer_client/train/``) with the Eagle-3
draft plug-in (``trainer_client/drafts/eagle3.py``). The names this package always exported
stay importable from here.

Importing this package does not import speculators; building or training a draft does.
"""

from trainer_client.drafts.base import MissingLayersError
from trainer_client.drafts.eagle3 import eagle3_layers
from trainer_client.train.checkpoints import latest_checkpoint, latest_draft
from trainer_client.train.trainer import OnlineTrainer, TrainConfig, TrainResult

#: The generic trainer; with ``TrainConfig.draft`` left at ``"eagle3"`` it trains Eagle-3.
Eagle3OnlineTrainer = OnlineTrainer

__all__ = [
    "Eagle3OnlineTrainer",
    "MissingLayersError",
    "TrainConfig",
    "TrainResult",
    "eagle3_layers",
    "latest_checkpoint",
    "latest_draft",
]
