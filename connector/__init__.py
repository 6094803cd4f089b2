"""Hidden-state streaming: the parts shared by every process, and the vLLM plug-in.

``connector.protocol``, ``connector.settings`` and ``connector.sample_tokens`` import
neither vLLM nor torch (nor, until a tokenizer is loaded, transformers); only
``connector.vllm_plugin`` imports vLLM, and it is loaded by vLLM itself through
``kv_connector_module_path``.
"""
