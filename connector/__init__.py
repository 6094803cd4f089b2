"""Hidden-state streaming: the parts shared by every process, and the vLLM plug-in.

``connector.protocol`` and ``connector.settings`` import neither vLLM nor torch; only
``connector.vllm_plugin`` imports vLLM, and it is loaded by vLLM itself through
``kv_connector_module_path``.
"""
