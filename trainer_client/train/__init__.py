"""The generic online trainer: the loop (``trainer.py``), the data path with prefetch and the
host→device copy (``data_path.py``), the step (``step.py``), the checkpoint-and-ack policy
(``checkpointing.py``, ``checkpoints.py``), the ranks (``distributed.py``), the settings
(``config.py``), loggers, vocabulary maps and the run (``run.py``). It knows no draft algorithm:
the draft plug-in (``trainer_client/drafts/``, by ``TrainConfig.draft``) says what a sample must
carry, how a batch is packed, the model, its loss and how vLLM serves its checkpoint.
"""
