"""Glue to third-party model libraries (transformers), each in a module of its own that imports the library only
when it is used."""
