"""The one base error of the contracts: a message, file or name that does not follow them."""

from __future__ import annotations


class ProtocolError(ValueError):
    """A message or file that does not follow this protocol; never silently accepted."""
