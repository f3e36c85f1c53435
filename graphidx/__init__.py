"""graphidx: the lightning indexer of DeepSeek-style sparse attention, inside FULL GPU graphs."""

from graphidx.config import IndexerConfig

__version__ = "0.1.0"

__all__ = ["IndexerConfig", "__version__"]
