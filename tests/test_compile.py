"""Models from `torch.compile` under every strategy, on 2 CPU ranks: parity with one uncompiled process on the
global batch (gradient accumulation and clipping included), the forward really compiled, and checkpoints under
the uncompiled model's names, loadable into a model that was never compiled.

The backend is "aot_eager": it runs Dynamo's capture and AOTAutograd's joint graph as inductor does, without
spending a C++ compile per rank; the last case uses inductor itself, the default users get."""

from __future__ import annotations

import pytest
import torch
from fsdp_models import Net, build_layout, layout_strategy, reference, train
from harness import run_ranks

from torchloom import Loom

# name -> (strategy, layout: how the user builds the model, see fsdp_models.build_layout)
CONFIGS = {
    "ddp": ("ddp", None),
    "fsdp-wrapped_root": ("fsdp", "wrapped_root"),
    "fsdp-units_plus_leftovers": ("fsdp", "units_plus_leftovers"),
    "fsdp2-wrapped_root": ("fsdp2", "wrapped_root"),
    "fsdp2-units_plus_leftovers": ("fsdp2", "units_plus_leftovers"),
}


def _compiled_run(loom: Loom, model: torch.nn.Module, path: str, backend: str) -> dict:
    from torch._dynamo.utils import counters

    model = loom.setup_module(torch.compile(model, backend=backend))
    opt = loom.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2))
    norms = train(loom, model, opt)
    loom.save(path, {"model": model, "optimizer": opt})
    return {
        "norms": norms,
        "graphs": counters["stats"]["unique_graphs"],
        # fully_shard gives a root it shards in place the class FSDP<its class>.
        "module": type(model.module).__name__.removeprefix("FSDP"),
        "keys": sorted(model.state_dict()),
    }


def _body(rank: int, world_size: int, tmp: str) -> dict:
    import torch._dynamo

    out = {}
    for name, (strategy, layout) in CONFIGS.items():
        torch._dynamo.reset()  # each case compiles afresh (and the counters start at 0)
        loom = Loom(
            accelerator="cpu",
            devices=world_size,
            strategy=layout_strategy(strategy, layout) if layout else strategy,
        )
        loom.launch()
        torch.manual_seed(0)
        model = build_layout(loom, strategy, layout) if layout else Net()
        out[name] = _compiled_run(loom, model, f"{tmp}/{name}", "aot_eager")
    return out


def _loaded(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's model, loaded in one process into a model that was never compiled."""
    loom = Loom(accelerator="cpu", devices=1)
    model = loom.setup_module(Net())
    loom.load(path, {"model": model}, strict=False)
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


@pytest.mark.timeout(600)
def test_compiled_models_train_like_one_uncompiled_process(tmp_path):
    expected, expected_norms = reference(Net)
    plain_keys = sorted(Net().state_dict())
    ranks = run_ranks(_body, 2, str(tmp_path), timeout=500)
    for name in CONFIGS:
        for rank, result in enumerate(ranks):
            run = result[name]
            assert run["graphs"] >= 1, (name, rank)  # the forward ran compiled
            assert run["module"] == "Net", (name, run["module"])  # .module is the uncompiled model
            assert run["keys"] == plain_keys, (name, run["keys"])
            torch.testing.assert_close(
                torch.tensor(run["norms"]), torch.tensor(expected_norms), atol=1e-5, rtol=1e-5
            )
        loaded = _loaded(str(tmp_path / name))
        for key, value in expected.items():
            torch.testing.assert_close(loaded[key], value, atol=1e-5, rtol=1e-5, msg=f"{name}: {key}")


def test_inductor_in_one_process(tmp_path):
    """The default backend, on the single-device strategy: same numbers as the uncompiled reference."""
    import torch._dynamo
    import torch._inductor.config

    torch._dynamo.reset()
    expected, expected_norms = reference(Net)
    loom = Loom(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    # Its C++ kernels compiled in this process: a pool of compile workers (one per core by default) would start
    # interpreters that import torch, for the few kernels of this model.
    with torch._inductor.config.patch(compile_threads=1):
        run = _compiled_run(loom, Net(), str(tmp_path / "ckpt.pt"), "inductor")
    assert run["graphs"] >= 1 and run["module"] == "Net"
    torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(expected_norms), atol=1e-5, rtol=1e-5)
    loaded = _loaded(str(tmp_path / "ckpt.pt"))
    for key, value in expected.items():
        torch.testing.assert_close(loaded[key], value, atol=1e-5, rtol=1e-5, msg=key)
