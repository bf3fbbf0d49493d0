"""Models: each family's block layout as data (``layouts``), supported architectures, facts read from a folder, hook
checks, and the built-in tiny and seeded models. Imports config/ and the shared names (components, sites) only."""
