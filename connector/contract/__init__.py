"""The shared kernel: the contracts every process imports (the connector inside vLLM, the
sidecar, the trainer, the CLI), each in one module. They import nothing of ours but each
other, and none of them imports vLLM, FastAPI or (at import time) torch.

=====================  =============================================================