"""Trainer-side client: iterate hidden states streamed from a sidecar, without vLLM installed."""

from trainer_client.stream import HiddenStateStream, InvalidSample, Sample, StreamError

__all__ = ["HiddenStateStream", "InvalidSample", "Sample", "StreamError"]
