"""The zarr store: claiming and locking its path, the journal, codecs, result arrays and flags, provenance, companion
files. Imports config/, models/, compile/ and the engine's result records; never kinds/ or report/.
"""
