"""Memory planning: each rank's peak memory predicted before launch (`torchloom plan`), and measured
(`track_memory()`, `loom.memory_summary()`) to hold the prediction against; `assume(value)` tells the plan what a
value the fake run cannot know is.

Layer 4: it runs a script whose strategies it may import; strategies never import it."""

from torchloom.planning.measure import MemorySummary, MemoryTracking, track_memory
from torchloom.planning.tracker import assume

__all__ = ["MemorySummary", "MemoryTracking", "assume", "track_memory"]
