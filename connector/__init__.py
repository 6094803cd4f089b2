"""Hidden-state streaming: the vLLM plug-in, and beside it the contracts every process imports.

==========================  ===============================================================
module                      job
==========================  ===============================================================
``contract/``               the shared kernel (wire messages, sample file, payload codecs,
                            spool rules, settings, endpoints, CURVE keys, tokenisation):
                            see its ``__init__``; no vLLM, FastAPI or torch at import
``transport/``              how a sample's bytes reach a trainer: one module per way, and
                            the registry the sidecar and the stream look them up in
``vllm_plugin``             the KV-connector class vLLM loads (``kv_connector_module_path:
                            connector.vllm_plugin``), the only module importing vLLM
``scheduler_side``          its half in vLLM's EngineCore: finished requests → saves
``step_metadata``           what that half tells the workers each step (saves, locks)
``worker_side``             its half in each worker: gather rows, copy them off the device
``spool_writer``            writer threads: encode, temp file → rename → notice
``cache_layout``, ``layers``  the draft cache's layout; layer ids and their stored order
``protocol``                the contracts' old single name (messages, sample file, spool
                            rules re-exported) for the readers docs/drop-in.md names
==========================  ===============================================================
"""
