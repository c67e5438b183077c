"""A user's training script under `torchloom run --replica-groups`, unchanged by fault tolerance, plus the faults
a test asks for. Usage: `ft_train.py OUT PLAN.json`; PLAN holds `groups`, `min_steps` and `events`.

Events fire in order, each once (a token file `OUT/event<k>.json`, made atomically, holds when and at which step
it fired), each only after the one before it has fired and after `after` steps that every group took part in
since then (read from the job's record, which all groups share). So a plan of kills never has more groups down
than it says. Each event names a group (`group`, or `groups` for `serve`), a `rank` in it (default 0) and where:

- `between` (after a commit), `forward`, `backward` (in a gradient hook), `allreduce` (right after the
  cross-group all-reduce was entered), `optimizer` (inside `optimizer.step()`, after the commit vote: one
  parameter is changed, then the process dies): SIGKILL there;
- `hang`: inside the all-reduce, before it is entered, the group sleeps `seconds` (a group alive but stuck);
- `serve`: the first of `groups` asked to send its state to a healing peer dies doing so;
- `healkill`: when group `group` heals, it SIGKILLs group `victim`'s rank 0 (a group killed during a heal);
- `lost`: the group dies at its first commit that misses a group (two groups lost in a row);
- `perturb`: after a commit, the group adds 1e-3 to one weight (a change outside `optimizer.step()` in one group
  only: its weights part from the others', which torchloom must find at the next step and never commit);
- `late` (with a kill): the group's next start waits until the others have committed `late` more steps;
- `pause` (with `at`: `between`, `forward` or `allreduce`): the whole process is stopped (SIGSTOP, its heartbeat
  threads too) for `seconds`, then continued, as a starved machine would stall it: alive, but silent.

The job ends when every event has fired, the job has committed `min_steps` steps and 4 since the last event had
every group: the first group to see it writes `OUT/stop.json` (a step 5 ahead), and every group stops after that
step. Each group's rank 0 then saves its parameters and step to `OUT/group<g>.pt`.
"""

import json
import os
import signal
import subprocess
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchloom import Loom
from torchloom import fault_tolerance as ft

OUT = sys.argv[1]
PLAN = json.loads(open(sys.argv[2]).read())
EVENTS = PLAN["events"]
GROUPS = PLAN["groups"]
RECORD = os.path.join(OUT, "record.jsonl")
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
GROUP = int(os.environ["TORCHLOOM_REPLICA_GROUP"])
RANK = int(os.environ.get("RANK", "0"))


def token(k):
    return os.path.join(OUT, f"event{k}.json")


def fired(k):
    if not os.path.exists(token(k)):
        return None
    with open(token(k)) as f:
        return json.load(f)


def claim(k, **info):
    """Fire event k once, for the whole job: the token appears with its content or not at all."""
    tmp = f"{token(k)}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(dict(info, time=time.time(), group=GROUP, rank=RANK, attempt=ATTEMPT), f)
    try:
        os.link(tmp, token(k))
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def lines():
    """The record's complete lines. Another group may be writing one now: a reader can see part of a line before
    its newline (one O_APPEND write keeps writers apart, not readers; a group crashed on such a half, seen once
    in `make test`), so the last piece counts only once its newline is there."""
    try:
        with open(RECORD) as f:
            return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]
    except FileNotFoundError:
        return []


def together_since(event):
    """Distinct steps with every group committed after `event` fired, and numbered after the step it fired in: a
    group killed inside `optimizer.step()` had its vote counted, so the survivors commit that step with it, after
    it died (counted, it let the next kill fire one step later: every group was lost, and the job started over)."""
    found = set()
    for line in lines():
        if (
            line["time"] > event["time"]
            and line["step"] > event["step"]
            and len({p["group"] for p in line["participants"]}) == GROUPS
        ):
            found.add(line["step"])
    return len(found)


def pending():
    """The next event to fire, if the one before it has fired and enough steps had every group since."""
    for k, event in enumerate(EVENTS):
        if fired(k) is None:
            before = fired(k - 1) if k else {"time": 0.0, "step": -1}
            if together_since(before) >= event.get("after", 0):
                return k, event
            return None
    return None


def mine(event):
    return GROUP in event.get("groups", [event.get("group")]) and RANK == event.get("rank", 0)


def die(k, **info):
    if claim(k, **info):
        os.kill(os.getpid(), signal.SIGKILL)


def wait_if_late():
    """A group killed with `late` comes back only after the others moved on by that many steps."""
    for k, event in enumerate(EVENTS):
        info = fired(k)
        if info and event.get("late") and event["group"] == GROUP:
            while max((line["step"] for line in lines()), default=-1) < info["step"] + event["late"]:
                time.sleep(0.1)


wait_if_late()
with open(os.path.join(OUT, f"pid.{GROUP}.{RANK}"), "w") as f:
    f.write(str(os.getpid()))
open(os.path.join(OUT, f"group{GROUP}.rank{RANK}.attempt{ATTEMPT}"), "w").close()

torch.manual_seed(0)
data = TensorDataset(torch.randn(24000, 4), torch.randn(24000, 1))
net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
raw = torch.optim.Adam(net.parameters(), lr=0.01)
loom = Loom(accelerator="cpu")
model, opt = loom.setup(net, raw)
loader = loom.setup_dataloaders(DataLoader(data, batch_size=4))
rg = ft.current()


def arm_serve(k):
    state = rg._state

    def serving():
        if all(fired(j) for j in range(k)):
            die(k, step=rg.step)
        return state()

    rg._state = serving  # torchft calls it when a peer heals from this group (its manager starts later)


def arm_healkill(k, victim):
    load = rg._load

    def healing(state):
        load(state)
        if all(fired(j) for j in range(k)):
            with open(os.path.join(OUT, f"pid.{victim}.0")) as f:
                pid = int(f.read())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                alive = b"ft_train.py" in f.read()
            if alive and claim(k, step=rg.step, victim=victim, pid=pid):
                os.kill(pid, signal.SIGKILL)

    rg._load = healing


for k, event in enumerate(EVENTS):
    if mine(event) and fired(k) is None:
        if event["where"] == "serve":
            arm_serve(k)
        if event["where"] == "healkill":
            arm_healkill(k, event["victim"])


def pause(k, seconds):
    """Stop this whole process for `seconds` or more: it stops itself here, at once, and a helper process
    continues it. (A helper that also sent the stop could start late on a loaded machine, and the process would
    run on past this point before it stopped.)"""
    if claim(k, step=rg.step):
        code = f"import os, signal, time; time.sleep({seconds}); os.kill({os.getpid()}, signal.SIGCONT)"
        subprocess.Popen([sys.executable, "-c", code])
        os.kill(os.getpid(), signal.SIGSTOP)


def arm(k, event):
    """Make this process die (or hang, or pause) where the event says, in the step about to run."""
    where = event["where"]
    if where == "pause" and event["at"] == "forward":

        def stall(*_):
            handle.remove()
            pause(k, event["seconds"])  # (returns None: the layer's input is left alone)

        handle = net[0].register_forward_pre_hook(stall)
        return
    if where == "pause" and event["at"] == "allreduce":
        real = rg._manager.allreduce

        def paused(*args, **kwargs):
            rg._manager.allreduce = real
            work = real(*args, **kwargs)
            pause(k, event["seconds"])
            return work

        rg._manager.allreduce = paused
        return
    if where == "forward":
        net[0].register_forward_pre_hook(lambda *_: die(k, step=rg.step))
    elif where == "backward":
        net[0].weight.register_hook(lambda *_: die(k, step=rg.step))
    elif where in ("allreduce", "hang"):
        real = rg._manager.allreduce

        def allreduce(*args, **kwargs):
            if where == "hang" and claim(k, step=rg.step):
                time.sleep(event["seconds"])  # stuck: torchloom's watchdog may end the process first
                rg._manager.allreduce = real
                return real(*args, **kwargs)
            work = real(*args, **kwargs)
            die(k, step=rg.step)
            return work

        rg._manager.allreduce = allreduce
    elif where == "optimizer":

        def partial(*_):
            with torch.no_grad():
                net[0].weight.add_(1.0)  # half an update: this state must never reach another group
            die(k, step=rg.step - 1)  # the vote has counted the step already

        raw.register_step_pre_hook(partial)


armed = set()
done = False
while not done:
    for x, y in loader:
        found = pending()
        if (
            found
            and mine(found[1])
            and found[0] not in armed
            and (
                found[1]["where"] in ("forward", "backward", "allreduce", "optimizer", "hang")
                or (found[1]["where"] == "pause" and found[1]["at"] != "between")
            )
        ):
            armed.add(found[0])
            arm(*found)
        before = rg.step
        loss = nn.functional.mse_loss(model(x), y)
        loom.backward(loss)
        opt.step()
        opt.zero_grad()
        if rg.step == before:
            continue  # the step failed: retried on the same batch
        together = len(rg.participants) == GROUPS
        found = pending()
        if found and mine(found[1]):
            k, event = found
            if event["where"] == "between" or (event["where"] == "lost" and not together):
                die(k, step=rg.step)
            if event["where"] == "perturb" and claim(k, step=rg.step):
                with torch.no_grad():
                    net[0].weight[0, 0] += 1e-3
            if event["where"] == "pause" and event["at"] == "between":
                pause(k, event["seconds"])
        if not together:
            time.sleep(0.2)  # alone: slow down until the others are back
        stop = os.path.join(OUT, "stop.json")
        events_done = all(fired(j) for j in range(len(EVENTS)))
        # 4 steps with every group since the last event (counted in the record: a group paused by the last event
        # is back in them, not merely before it).
        last = fired(len(EVENTS) - 1) if EVENTS else {"time": 0.0, "step": -1}
        if (
            events_done
            and together_since(last) >= 4
            and rg.step >= PLAN["min_steps"]
            and not os.path.exists(stop)
        ):
            tmp = f"{stop}.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"step": rg.step + 5}, f)
            try:
                os.link(tmp, stop)
            except FileExistsError:
                pass
            os.unlink(tmp)
        if os.path.exists(stop):
            with open(stop) as f:
                if rg.step >= json.load(f)["step"]:
                    done = True
                    break

if RANK == 0:
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    torch.save({"state": state, "step": rg.step}, os.path.join(OUT, f"group{GROUP}.pt"))
