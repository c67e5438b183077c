# DEV STUB, NOT TO COMMIT
import torch
from torch.utils.flop_counter import FlopCounterMode
class ThroughputMonitor:
    def __init__(self, fabric, **kw): self.fabric = fabric
    def update(self, **kw): pass
    def compute(self): return {}
    def compute_and_log(self, **kw): return {}
    def reset(self): pass
class Throughput: pass
def measure_flops(model, forward_fn, loss_fn=None):
    with FlopCounterMode(display=False) as c:
        y = forward_fn()
        if loss_fn is not None: loss_fn(y).backward()
    return c.get_total_flops()
