"""The contracts' old single module, kept as a name: ``connector.protocol`` is what
docs/drop-in.md's readers and earlier scripts import (``protocol.remove_from_spool``).

Everything here is re-exported from ``connector/contract/``: the wire messages
(``messages.py``), the sample file (``sample_file.py``), the spool's rules (``spool.py``).
New code imports those modules.
"""

from __future__ import annotations

from connector.contract.errors import ProtocolError  # noqa: F401
from connector.contract.messages import *  # noqa: F403
from connector.contract.messages import _BODY, _TYPE_OF  # noqa: F401
from connector.contract.payload import ELEMENT_SIZES as DTYPE_SIZES  # noqa: F401
from connector.contract.sample_file import *  # noqa: F403
from connector.contract.spool import *  # noqa: F403
