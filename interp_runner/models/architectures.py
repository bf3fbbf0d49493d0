"""Supported model families: HF architecture name -> vLLM decoder-layer class that the plugin instruments.

All of them are pre-norm blocks with the same site layout (see ``interp_runner.sites``).
"""

DECODER_LAYERS = {
    "LlamaForCausalLM": ("vllm.model_executor.models.llama", "LlamaDecoderLayer"),
    "MistralForCausalLM": ("vllm.model_executor.models.mistral", "MistralDecoderLayer"),
    "Qwen2ForCausalLM": ("vllm.model_executor.models.qwen2", "Qwen2DecoderLayer"),
    "Qwen3ForCausalLM": ("vllm.model_executor.models.qwen3", "Qwen3DecoderLayer"),
}
