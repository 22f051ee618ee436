"""Ranks as threads of one process: the baton that runs one at a time, the process-wide patches, the job runner."""

__all__: list[str] = []
