"""``python -m meshviz.launch``: Paddle's launcher flags on torchrun's elastic agent."""

from .main import build_config, launch, main, parse_args

__all__ = ["main", "launch", "parse_args", "build_config"]
