"""Ways to make ranks under one Runner/Job contract (processes, threads, simulated), and the one place errors are
assembled."""

__all__: list[str] = []
