import os
import sys
from pathlib import Path

# Ranks share 2 cores; keep intra-op threads from oversubscribing them (also inherited by spawned ranks).
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))
