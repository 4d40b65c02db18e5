"""The distributed runtime (how tensors move): the process group and its primitives (``comm.py``), the shared-memory
transport of CPU ranks on one host (``same_host.py``), the data collectives with their stream choreography
(``collectives.py``), side streams, fences and work in flight (``streams.py``), the run context handed to every part
of an engine (``context.py``), logging by rank (``logs.py``) and the collective watchdog (``watchdog.py``).

Nothing is imported here: a module below ``runtime`` that needs one of these imports it from its own file."""
