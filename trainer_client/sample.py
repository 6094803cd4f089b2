"""``Sample``: one checked sample as the stream (or :func:`read_hidden_states`) hands it over."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from connector.contract import messages as M
from connector.contract import payload as PL


@dataclass
class Sample:
    key: M.SampleKey | None  # None: a file read directly (a plain vLLM request, no sidecar)
    token_ids: torch.Tensor  # [T] int64
    hidden_states: torch.Tensor  # [T, K, H] in the file's layer order
    layer_ids: list[int]
    num_hidden_layers: int
    loss_mask: torch.Tensor | None = None  # [T] bool
    label: str | None = None
    notice: M.Notice | None = field(default=None, repr=False)
    #: float32 [T, 1, 1] while ``hidden_states`` is still FP8 (``connector/contract/payload.py``);
    #: None for an unquantised payload and once dequantised.
    scales: torch.Tensor | None = field(default=None, repr=False)
    #: Where this sample's time went in the stream (see :meth:`HiddenStateStream.__iter__`):
    #: wall-clock stamps (``received``, ``started``, ``checked``, ``handed``; ``time.time()``,
    #: the clock of ``notice.sent_at``) and phase durations in seconds (``alloc_s``, ``read_s``,
    #: ``checksum_s``, ``finite_s``, ``to_device_s``).
    timings: dict[str, float] = field(default_factory=dict, repr=False)

    def dequantized(self, dtype: torch.dtype | None) -> Sample:
        """This sample with encoded hidden states (FP8: x = fp8 × its token's scale) decoded into
        ``dtype`` by its payload's codec; unchanged if they are not encoded or ``dtype`` is None
        (the trainer decodes itself)."""
        codec = PL.CODECS.get(str(self.hidden_states.dtype).removeprefix("torch."))
        if dtype is None or codec is None or not codec.encoded or (codec.extra_tensors and self.scales is None):
            return self
        extras = {PL.SCALES_KEY: self.scales} if self.scales is not None else {}
        return replace(self, hidden_states=codec.decode(self.hidden_states, extras, dtype), scales=None)

    @property
    def aux_hidden_states(self) -> torch.Tensor:
        """The layers below N ([T, K', H]): the draft's input features."""
        idx = [i for i, lid in enumerate(self.layer_ids) if lid != self.num_hidden_layers]
        return self.hidden_states[:, idx]

    @property
    def last_hidden_state(self) -> torch.Tensor | None:
        """Layer N, the pre-norm final state ([T, H]) the targets come from; None if absent."""
        if self.num_hidden_layers not in self.layer_ids:
            return None
        return self.hidden_states[:, self.layer_ids.index(self.num_hidden_layers)]
