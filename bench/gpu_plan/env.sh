# Sourced by every device call of docs/gpu-plan.md, from the checkout's root, after the vLLM 0.26
# bundle is unpacked in /tmp/site (/work/shared/gpu/README.md): vLLM and its packages first, this
# checkout next (kv_connector_module_path finds our connector there), no network, no flashinfer.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0 VLLM_NO_USAGE_STATS=1
export PATH=/tmp/site/bin:$PATH
