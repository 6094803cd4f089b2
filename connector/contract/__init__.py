"""The shared kernel: the contracts every process imports (the connector inside vLLM, the
sidecar, the trainer, the CLI), each in one module. They import nothing of ours but each
other, and none of them imports vLLM, FastAPI or (at import time) torch.

=====================  ====================================================================
module                 contract
=====================  ====================================================================
``errors``             ``ProtocolError``, the base of every contract error
``messages``           the wire messages and their version (notice, HELLO … END, the
                       sidecar's tag in ``kv_transfer_params``)
``sample_file``        what a sample file holds: tensor keys, checksum and the bytes it
                       covers, sizes, the one header parser
``payload``            payload dtypes, one codec class each, in a registry
``spool``              spool names, the marker, resolve/remove/retire, the lock files
``settings``           every ``HSSTREAM_*`` setting
``endpoints``          which socket endpoints may go without CURVE
``curve_keys``         CURVE key files (written and loaded with their permissions checked)
``sample_tokens``      a REST sample's token ids and loss masks (sidecar and trainer alike)
``rest``               the REST API's request and response bodies (the routes' models)
``rest_client``        ``SidecarClient``, the one typed client of that API
``vllm_hooks``         when each of vLLM's model runners calls the connector's worker hooks
                       in a step, as read in vLLM's source (the hook-order test drives it)
=====================  ====================================================================
"""
