"""Trainer-side client: iterate hidden states streamed from a sidecar, without vLLM installed."""

from trainer_client.stream import HiddenStateStream, InvalidSample, Sample, StreamError, StreamOptions, read_hidden_states

__all__ = ["HiddenStateStream", "InvalidSample", "Sample", "StreamError", "StreamOptions", "read_hidden_states"]
