"""What the benchmark scripts share: launching a run's ranks under a memory watchdog, the models and systems
they train, the machine's description and peak, and the tables and plots made from raw rows.

Scripts import it as ``harness`` after putting ``benchmarks/`` on ``sys.path``; nothing here is part of zinf."""
