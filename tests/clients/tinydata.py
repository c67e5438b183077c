"""What litgpt's scripts read in tests/clients, made here with no download: a pythia-shaped tiny model's config,
a character-level tokenizer, random token sequences for `pretrain` and an instruction file for LoRA."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from litgpt.data import DataModule
from torch.utils.data import DataLoader

VOCAB = 64
BLOCK = 16

#: pythia-14m's shape (GPT-NeoX: parallel residual, partial rotary, LayerNorm, GptNeoxMLP), a few sizes.
CONFIG = {
    "name": "tiny-pythia",
    "hf_config": {"org": "none", "name": "tiny-pythia"},
    "block_size": BLOCK,
    "vocab_size": VOCAB,
    "padded_vocab_size": VOCAB,
    "padding_multiple": 64,
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 16,
    "rotary_percentage": 0.25,
    "parallel_residual": True,
    "bias": True,
    "norm_class_name": "LayerNorm",
    "mlp_class_name": "GptNeoxMLP",
    "intermediate_size": 64,
}


@dataclass
class RandomTokens(DataModule):
    """Sequences of random token ids from a fixed seed: nothing to download or tokenize."""

    n_train: int = 32
    n_val: int = 8
    seed: int = 1234
    batch_size: int = field(default=1, init=False, repr=False)
    max_seq_length: int = field(default=BLOCK, init=False, repr=False)

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int = BLOCK) -> None:
        self.batch_size = batch_size
        self.max_seq_length = max_seq_length

    def setup(self, stage: str = "") -> None:
        generator = torch.Generator().manual_seed(self.seed)
        tokens = torch.randint(
            0, VOCAB, (self.n_train + self.n_val, self.max_seq_length + 1), generator=generator
        )
        self.train, self.val = tokens[: self.n_train], tokens[self.n_train :]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(list(self.train), batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(list(self.val), batch_size=self.batch_size, shuffle=False)


def write_tokenizer(folder: Path) -> None:
    """A character-level tokenizer (tokenizer.json, tokenizer_config.json) with VOCAB ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = "abcdefghijklmnopqrstuvwxyz .,:!?\n#0123456789ABCDEFGHIJKLMNOPQRSTU"
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    for ch in chars:
        if len(vocab) < VOCAB and ch not in vocab:
            vocab[ch] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "tokenizer_class": "Tiny"}
        )
    )


def write_instructions(path: Path, n: int = 24) -> None:
    """An Alpaca-style JSON file for litgpt's JSON data module."""
    rows = [{"instruction": f"add {i} and {i + 1}", "input": "", "output": f"{2 * i + 1}"} for i in range(n)]
    path.write_text(json.dumps(rows))


def write_fixtures(folder: Path) -> dict[str, Path]:
    """Everything litgpt's scripts read, under `folder`: the base model's checkpoint directory (`base/`: random
    weights, config, tokenizer, instructions) and one config file per script."""
    import yaml
    from litgpt.config import Config
    from litgpt.model import GPT

    base = folder / "base"
    base.mkdir(parents=True, exist_ok=True)
    (base / "model_config.yaml").write_text(yaml.safe_dump(CONFIG))
    write_tokenizer(base)
    write_instructions(base / "instructions.json")
    torch.manual_seed(3)
    torch.save(GPT(Config(**CONFIG)).state_dict(), base / "lit_model.pth")
    common = {"precision": "32-true", "logger_name": "csv"}
    pretrain = {
        **common,
        "model_name": "tiny-pythia",
        "model_config": CONFIG,
        "data": {"class_path": "tinydata.RandomTokens"},
        "seed": 7,
        "train": {
            "micro_batch_size": 2,
            "global_batch_size": 4,
            "max_tokens": 256,  # 8 micro-batches of 2 x 16 tokens on one process, 4 steps on any number
            "lr_warmup_steps": 1,
            "save_interval": 2,
            "log_interval": 1,
            "min_lr": 1e-4,
        },
        "eval": {"interval": 100, "max_iters": 2},
        "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01, "weight_decay": 0.1}},
    }
    lora = {
        **common,
        "checkpoint_dir": str(base),
        "seed": 5,
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.1,
        "data": {
            "class_path": "litgpt.data.JSON",
            "init_args": {
                "json_path": str(base / "instructions.json"),
                "val_split_fraction": 0.25,
                "num_workers": 0,
            },
        },
        "train": {
            "epochs": 1,
            "micro_batch_size": 2,
            "global_batch_size": 4,
            "save_interval": 2,
            "log_interval": 1,
            "lr_warmup_steps": 1,
            "max_seq_length": BLOCK,
        },
        "eval": {"interval": 100, "max_iters": 2, "max_new_tokens": 4, "initial_validation": False},
        "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}},
    }
    paths = {"base": base, "pretrain": folder / "pretrain.yaml", "lora": folder / "lora.yaml"}
    paths["pretrain"].write_text(yaml.safe_dump(pretrain))
    paths["lora"].write_text(yaml.safe_dump(lora))
    return paths
