"""Memory planning: each rank's peak memory predicted before launch (`torchloom plan`), and measured
(`track_memory()`, `loom.memory_summary()`) to hold the prediction against.

Layer 4: it runs a script whose strategies it may import; strategies never import it."""

from torchloom.planning.measure import MemorySummary, MemoryTracking, track_memory

__all__ = ["MemorySummary", "MemoryTracking", "track_memory"]
