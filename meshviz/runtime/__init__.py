"""The runtime floor: the world, groups, the comm door, devices, reshards, the dist tensor and its op layer."""

__all__: list[str] = []
