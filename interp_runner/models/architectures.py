"""Supported model families: HF architecture name -> vLLM decoder-layer class that the plugin instruments.

All of them are pre-norm blocks with the same site layout (see ``interp_runner.sites``).
"""

DECODER_LAYERS = {
    "LlamaForCausalLM": ("vllm.model_executor.models.llama", "LlamaDecoderLayer"),
    "MistralForCausalLM": ("vllm.model_executor.models.mistral", "MistralDecoderLayer"),
    "Qwen2ForCausalLM": ("vllm.model_executor.models.qwen2", "Qwen2DecoderLayer"),
    "Qwen3ForCausalLM": ("vllm.model_executor.models.qwen3", "Qwen3DecoderLayer"),
}

# HF architecture -> llama.cpp's name for it (the GGUF ``general.architecture`` its converter writes, which
# ``cvector-generator`` copies into a control vector's ``controlvector.model_hint``); convert_hf_to_gguf.py converts
# MistralForCausalLM as llama
LLAMA_CPP_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
