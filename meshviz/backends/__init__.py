"""c10d process-group backends of meshviz's own: ``"threads"`` (ranks as threads of one process)."""

__all__: list[str] = []
