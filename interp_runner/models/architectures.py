"""Supported model families by HF architecture name, derived from their block layouts (``layouts.LAYOUTS``).

``DECODER_LAYERS``: HF architecture -> the vLLM decoder-layer class the plugin instruments.
``LLAMA_CPP_ARCH``: HF architecture -> llama.cpp's name for it (the GGUF ``general.architecture`` its converter
writes, which ``cvector-generator`` copies into a control vector's ``controlvector.model_hint``).
"""

from interp_runner.models.layouts import BY_ARCHITECTURE

DECODER_LAYERS = {arch: layout.decoder_layer for arch, layout in BY_ARCHITECTURE.items()}
LLAMA_CPP_ARCH = {arch: layout.llama_cpp_arch for arch, layout in BY_ARCHITECTURE.items()}
