"""Judge one scenario's results against its oracles: (a) plain torch on the global batch, (b) the
uninterrupted run for a resume, (c) the declared refusals. Returns the problems found (empty: it passed)."""

from __future__ import annotations

import torch

from .axes import Scenario
from .model import STEPS, accumulation
from .reference import train_reference
from .refusals import Refusal, declared, declared_all

FP32_TOLERANCE = 1e-5
# Low precisions cannot match fp32 to 1e-5. They are judged against how far training moved the weights, as the
# bf16/fp16 parity tests of tests/strategies do, but over the whole update rather than its largest element:
# Adam turns rounding noise in a near-zero gradient into a step of size lr in either direction, so one
# element's error can be as large as its movement while the update as a whole is right.
# The allowed relative error ||(run - initial) - (reference - initial)|| / ||reference - initial|| is the
# larger of a floor per precision and twice the precision's own noise in this scenario (how far the same
# reference trained in fp32 lands from the low-precision one) (bf16-true SGD loses most small updates to rounding, so
# there the noise is of the order of the movement itself, and the comparison says little; the report shows it).
UPDATE_ERROR = {"bf16-mixed": 0.05, "16-mixed": 0.02, "bf16-true": 0.2}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise AssertionError(f"different keys: {sorted(set(a) ^ set(b))}")
    return max(((a[k].float() - b[k].float()).abs().max().item() for k in a), default=0.0)


def _optim_diff(a: dict, b: dict) -> tuple[float, str]:
    """The largest difference between two name-keyed optimizer states, and where it is."""
    if a.keys() != b.keys():
        return float("inf"), f"state for different parameters: {sorted(set(a) ^ set(b))}"
    worst, where = 0.0, ""
    for name in a:
        if a[name].keys() != b[name].keys():
            return float("inf"), f"{name}: entries {sorted(a[name])} vs {sorted(b[name])}"
        for key in a[name]:
            d = (
                (a[name][key].float() - b[name][key].float()).abs().max().item()
                if a[name][key].numel()
                else 0.0
            )
            if d > worst:
                worst, where = d, f"{name}.{key}"
    return worst, where


def _update_error(got: dict, expected: dict, initial: dict) -> float:
    """||(got - initial) - (expected - initial)|| / ||expected - initial|| over every parameter together."""
    num = sum(((got[k].float() - expected[k].float()) ** 2).sum().item() for k in expected)
    den = sum(((expected[k].float() - initial[k].float()) ** 2).sum().item() for k in expected)
    return (num / den) ** 0.5 if den else float("inf")


def _error(scenario: Scenario, got: dict, expected: dict, initial: dict) -> float:
    if scenario.precision == "32-true":
        return _max_diff(got, expected)
    return _update_error(got, expected, initial)


def _params_problem(
    scenario: Scenario, got: dict, expected: dict, initial: dict, what: str, allowed: float
) -> str | None:
    """The comparison of one parameter set with what it should be, in the scenario's precision's terms."""
    if got.keys() != expected.keys():
        return f"{what}: different parameter names: {sorted(set(got) ^ set(expected))}"
    if scenario.precision == "32-true":
        d = _max_diff(got, expected)
        return None if d <= allowed else f"{what} by {d:.3g} (fp32 allows {allowed:.3g})"
    err = _update_error(got, expected, initial)
    return None if err <= allowed else f"{what}: relative update error {err:.3g} (allowed {allowed:.3g})"


def _allowed_update_error(
    scenario: Scenario, reference: dict, initial: dict, metrics: dict, noise_aware: bool = True
) -> float:
    """fp32: the largest difference allowed (`noise_aware`: at least twice fp32's own noise, else 1e-5); low
    precision: the relative update error allowed."""
    if scenario.precision == "32-true" and not noise_aware:
        return FP32_TOLERANCE
    if scenario.precision == "32-true":
        # fp32's own noise in this scenario: how far the reference lands from itself with each global batch's
        # samples summed in the reverse order, and from the same training in float64. Adam turns the rounding
        # of a gradient element that happens to be near zero into a step of up to lr: a random run found a
        # scenario whose first gradient held 1.5e-7 among elements of 0.026, where plain torch in another
        # summation order lands 1.8e-5 away (SGD, linear in the gradient, reproduces it to 3e-8).
        reordered = train_reference(scenario, initial, reverse_batches=True)
        exact = train_reference(scenario, initial, float64=True)
        noise = max(
            _max_diff(reference["params"], reordered["params"]),
            _max_diff(reference["params"], exact["params"]),
        )
        metrics["precision_noise"] = noise
        return max(FP32_TOLERANCE, 2 * noise)
    fp32 = Scenario.of(**{**scenario.as_dict(), "precision": "32-true"})
    noise = _update_error(reference["params"], train_reference(fp32, initial)["params"], initial)
    metrics["precision_noise"] = noise
    # Two runs, each within the noise of the fp32 trajectory, can be twice the noise apart.
    return max(UPDATE_ERROR[scenario.precision], 2 * noise)


def _global(
    rank_results: list[dict], tp: int = 1, dp: int | None = None, key: str = "seen"
) -> list[list[int]]:
    """Each micro-batch's global batch: the union of the data-parallel ranks' samples, sorted. The mesh is
    (pipeline, data, tensor) ranks, the last the fastest: the ranks of one tensor-parallel group and of one
    pipeline read the same batch, and the first rank of each data-parallel index stands for them."""
    dp = len(rank_results) // tp if dp is None else dp
    first = [(i // tp) % dp * tp for i in range(len(rank_results))]
    if any(r[key] != rank_results[first[i]][key] for i, r in enumerate(rank_results)):
        return [[-2]]  # a tensor-parallel group or a pipeline whose ranks read different batches
    rank_results = [rank_results[d * tp] for d in range(dp)]
    steps = len(rank_results[0][key])
    if any(len(r[key]) != steps for r in rank_results):
        return [[-1]]
    return [sorted(i for r in rank_results for i in r[key][m]) for m in range(steps)]


FROZEN = "pos.weight"  # model.Net's frozen parameter (the frozen axis)


def _frozen_problems(phase: str, results: list[dict], initial: dict) -> list[str]:
    """A frozen parameter never moves and gets no optimizer state, in any precision (the parameters' tolerance
    of a low precision, and its lack of an optimizer-state check, would let a frozen weight drift)."""
    out = []
    for rank, res in enumerate(results):
        if not torch.equal(res["params"][FROZEN], initial[FROZEN]):
            d = (res["params"][FROZEN] - initial[FROZEN]).abs().max().item()
            out.append(f"{phase}: rank {rank}'s frozen {FROZEN} moved by {d:.3g}")
        if FROZEN in res["optim"]:
            out.append(f"{phase}: rank {rank}'s optimizer holds state for the frozen {FROZEN}")
    return out


def _evals_problem(phase: str, got: list, expected: list, scenario: Scenario, allowed: float) -> str | None:
    """The validation losses `loom.evaluate` returned against the reference's (eval mode: BatchNorm's running
    statistics). fp32: within 20x the parameters' tolerance, relative (a loss sums many parameters' errors);
    low precision: within the relative update error allowed."""
    if [s for s, _ in got] != [s for s, _ in expected]:
        return f"{phase}: evaluated after steps {[s for s, _ in got]}, the reference after {[s for s, _ in expected]}"
    rel = 20 * allowed if scenario.precision == "32-true" else allowed
    for (step, a), (_, b) in zip(got, expected, strict=True):
        if not abs(a - b) <= rel * max(abs(b), 1.0):
            return f"{phase}: validation loss after step {step} is {a:.6g}, the reference's {b:.6g}"
    return None


def _errors(results: list[dict]) -> list[str]:
    return [
        f"rank {r}: {res['error_type']}: {res['error']}\n{res.get('traceback', '')}"
        for r, res in enumerate(results)
        if not res.get("ok")
    ]


def _check_refusal(scenario: Scenario, phase: str, results: list[dict]) -> tuple[list[str], str | None, bool]:
    """(problems, refusal name, whether the phase ran to its end)."""
    refusal = declared(scenario, phase)
    errors = _errors(results)
    if refusal is None:
        return (
            ([f"{phase}: raised, and no refusal is declared:\n" + errors[0]] if errors else []),
            None,
            not errors,
        )
    if len(errors) != len(results):
        return (
            [f"{phase}: must be refused ({refusal.name}: {refusal.reason}) on every rank, but ran"],
            None,
            False,
        )
    # Where several refusals apply, the one whose check comes first in the user's code is raised (Loom(...)
    # before setup_module before setup_optimizers): any of them will do, the same on every rank.
    candidates = declared_all(scenario, phase)

    def matches(res: dict) -> Refusal | None:
        return next(
            (r for r in candidates if r.error in res["error_mro"] and r.fragment in res["error"]), None
        )

    met = [matches(res) for res in results]
    bad = [e for e, m in zip(errors, met, strict=True) if m is None]
    if not bad and len({m.name for m in met}) > 1:
        bad = [f"ranks raised different refusals: {[m.name for m in met]}"]
    if not bad:
        refusal = met[0]
    if bad:
        return (
            [
                f"{phase}: refused, but not with {refusal.error} '{refusal.fragment}' ({refusal.name}):\n{bad[0]}"
            ],
            None,
            False,
        )
    return [], refusal.name, False


def judge(
    scenario: Scenario, trained: list[dict], resumed: list[dict] | None, metrics: dict | None = None
) -> tuple[list[str], str | None]:
    """The problems of one scenario (empty: it passed) and the declared refusal it met, if any. `metrics`, if
    given, receives the measured errors (for reports and for calibrating the tolerances). fp32 is judged at
    1e-5 first; only a scenario that misses it is judged again at twice plain torch's own noise, if larger (two
    more reference runs, spent only where needed)."""
    metrics = {} if metrics is None else metrics
    problems, refused = _judge(scenario, trained, resumed, metrics, noise_aware=False)
    if problems and scenario.precision == "32-true" and "initial" in trained[0]:
        problems, refused = _judge(scenario, trained, resumed, metrics, noise_aware=True)
    return problems, refused


def _judge(
    scenario: Scenario,
    trained: list[dict],
    resumed: list[dict] | None,
    metrics: dict | None = None,
    noise_aware: bool = True,
) -> tuple[list[str], str | None]:
    """The problems of one scenario (empty: it passed) and the declared refusal it met, if any. `metrics`, if
    given, receives the measured errors (for reports and for calibrating the tolerances)."""
    metrics = {} if metrics is None else metrics
    problems, refused, ran = _check_refusal(scenario, "train", trained)
    if not ran:
        return problems, refused
    initial = trained[0]["initial"]
    reference = train_reference(scenario, initial)
    metrics["train_error"] = _error(scenario, trained[0]["params"], reference["params"], initial)
    allowed = _allowed_update_error(scenario, reference, initial, metrics, noise_aware)
    metrics["clipped_steps"] = reference["clipped"]
    if scenario.precision != "32-true" and _max_diff(reference["params"], initial) < 1e-3:
        problems.append("the reference hardly moved: the low-precision tolerance has no teeth")
    # (a) every rank's gathered parameters and optimizer state against one process on the global batch.
    seen = _global(trained, scenario.tp("train"), scenario.readers("train"))
    if seen != reference["batches"]:
        problems.append(
            f"train: global batches differ from the sampler's order:\n{seen}\nvs\n{reference['batches']}"
        )
    for rank, res in enumerate(trained):
        if res.get("diverged"):
            problems.append(
                f"train: rank {rank}'s stages differ from their replicas' at {res['diverged'][:5]}"
            )
    for rank, res in enumerate(trained):
        if rank and _max_diff(res["params"], trained[0]["params"]) != 0:
            problems.append(f"train: rank {rank}'s parameters differ from rank 0's (replicas diverged)")
        if problem := _params_problem(
            scenario,
            res["params"],
            reference["params"],
            initial,
            f"train: rank {rank} off the reference",
            allowed,
        ):
            problems.append(problem)
        if scenario.precision == "32-true":
            od, where = _optim_diff(res["optim"], reference["optim"])
            if not od <= allowed:
                problems.append(
                    f"train: rank {rank} optimizer state off the reference by {od:.3g} at {where}"
                )
    if scenario.frozen:
        problems += _frozen_problems("train", trained, initial)
    # The norms clip_gradients returned (before clipping): clipping to a norm hides how large the gradients
    # were from the parameters, not from these.
    if len(trained[0]["norms"]) != len(reference["norms"]):
        problems.append(
            f"train: {len(trained[0]['norms'])} clip norms, the reference has {len(reference['norms'])}"
        )
    else:
        rel = FP32_TOLERANCE if scenario.precision == "32-true" else allowed
        for i, (a, b) in enumerate(zip(trained[0]["norms"], reference["norms"], strict=True)):
            if not abs(a - b) <= rel * abs(b) + 1e-7:
                problems.append(f"train: clip norm {i} is {a:.6g}, the reference's {b:.6g}")
                break
    if problem := _evals_problem("train", trained[0]["evals"], reference["evals"], scenario, allowed):
        problems.append(problem)
    if scenario.precision == "16-mixed" and trained[0].get("scale") != reference["scale"]:
        problems.append(
            f"train: loss scale {trained[0].get('scale')} vs the reference's {reference['scale']}"
        )
    if not scenario.saves:
        return problems, refused
    # (b) the resumed run against the uninterrupted one: same batches after the save, same end.
    if resumed is None:
        problems.append("resume: no result (the resume phase did not run this scenario)")
        return problems, refused
    more, refused_resume, ran = _check_refusal(scenario, "resume", resumed)
    problems += more
    if not ran:
        return problems, refused or refused_resume
    after = scenario.save_step * accumulation(scenario)
    if resumed[0]["loaded_step"] != scenario.save_step:
        problems.append(f"resume: loaded step {resumed[0]['loaded_step']}, saved at {scenario.save_step}")
    seen = _global(resumed, scenario.tp("resume"), scenario.readers("resume"))
    if seen != reference["batches"][after:]:
        problems.append(
            f"resume: global batches after the load differ from the uninterrupted run's:\n{seen}\n"
            f"vs\n{reference['batches'][after:]}"
        )
    uninterrupted = trained[0]
    if scenario.ckpt_state not in ("all", "raw"):
        # What the checkpoint did not hold restarts at the load: plain torch says where that run ends.
        uninterrupted = train_reference(scenario, initial, restart=True)
    metrics["resume_error"] = _error(scenario, resumed[0]["params"], uninterrupted["params"], initial)
    if scenario.frozen:
        problems += _frozen_problems("resume", resumed, initial)
    evals_after = [e for e in uninterrupted["evals"] if e[0] > scenario.save_step]
    if problem := _evals_problem("resume", resumed[0]["evals"], evals_after, scenario, allowed):
        problems.append(problem)
    for rank, res in enumerate(resumed):
        if problem := _params_problem(
            scenario,
            res["params"],
            uninterrupted["params"],
            initial,
            f"resume: rank {rank} off the uninterrupted run",
            allowed,
        ):
            problems.append(problem)
        od, where = _optim_diff(res["optim"], uninterrupted["optim"])
        if scenario.precision == "32-true" and not od <= allowed:
            problems.append(
                f"resume: rank {rank} optimizer state off the uninterrupted run by {od:.3g} at {where}"
            )
        elif od == float("inf"):
            problems.append(f"resume: rank {rank} optimizer state differs in shape: {where}")
    assert STEPS > scenario.save_step
    return problems, refused
