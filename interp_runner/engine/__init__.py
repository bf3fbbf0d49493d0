"""The embedded vLLM engine: building it with the plugin on, vLLM's rules for our settings, start-up phases, the kernel
path, the GPUs of sweep jobs. Imports config/, compile/, models/, the plugin's switches and the shared records; never
store/, kinds/ or report/.
"""
