"""litgpt 0.5.13's `finetune/lora_legacy.py` from the command line: its CLI no longer names it, so this is the
two lines its `litgpt finetune_lora` entry would be (litgpt itself unchanged)."""

from jsonargparse import CLI
from litgpt.finetune.lora_legacy import setup

if __name__ == "__main__":
    CLI(setup)
