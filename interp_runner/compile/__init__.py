"""Compiling a validated config into a plan and its vLLM requests: prompts, inputs, tokens, selectors, steering and
patching entries, packing, teacher forcing, certain overflow. Imports config/, models/, vectors/ and the shared
records (contracts, payload, sites); never engine/, store/, kinds/ or plugin/.
"""
