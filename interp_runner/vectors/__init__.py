"""Steering vectors: loading them from configs and files, vector stores, methods that derive them, GGUF control
vectors. Imports config/ and models/ only.
"""
