"""Eagle-3 online training on streamed hidden states, built on speculators' ``Eagle3DraftModel``.

Importing this package does not import speculators; building or training a draft does.
"""

from trainer_client.eagle3.features import MissingLayersError, eagle3_layers
from trainer_client.eagle3.model import latest_checkpoint, latest_draft
from trainer_client.eagle3.trainer import Eagle3OnlineTrainer, TrainConfig, TrainResult

__all__ = [
    "Eagle3OnlineTrainer",
    "MissingLayersError",
    "TrainConfig",
    "TrainResult",
    "eagle3_layers",
    "latest_checkpoint",
    "latest_draft",
]
