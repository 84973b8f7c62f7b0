"""DDP replay results as they were before the step program (the regression reference).

``python tests/ddp_golden.py`` (re)writes ``tests/data/ddp_replay_golden.json``: every zoo
scenario captured once, each replayed under a set of knob configurations on both engines, the
figures kept as exact float hex. ``tests/test_ddp_replay_regression.py`` replays the stored
captures and asserts the figures are bit for bit these. Regenerate only when a change of the
*model* is intended, and say so in the commit.

The first twelve configurations are the α–β network as it was: NCCL's tuning model and the
GPU's contention, on by default on NCCL presets since, are switched off explicitly
(:data:`PLAIN`), so their figures stay bit for bit those of before the defaults. The
``defaults-*`` configurations pin the defaults themselves (``"defaults": true``).
``python tests/ddp_golden.py --add`` computes only the results missing from the file, on its
stored captures.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

PATH = os.path.join(os.path.dirname(__file__), "data", "ddp_replay_golden.json")

# (scenario, capture ranks), (world, knobs) pairs: every knob replay has, on both engines
CONFIGS: list[tuple[str, int, dict[str, Any]]] = [
    ("default", 2, {}),
    ("world-64", 64, {"network": "ib8"}),
    ("bucket-1mb-fp16", 16, {"network": "ib8", "bucket_cap_mb": 0.01, "comm_hook": "fp16"}),
    ("bf16", 8, {"comm_hook": "bf16"}),
    ("powersgd", 8, {"network": "ib8", "comm_hook": "powersgd", "powersgd_rank": 2,
                     "iterations": 2}),
    ("jitter-stragglers", 48, {"network": "ib8", "jitter": 0.05, "seed": 3,
                                "rank_speed": {3: 0.5, 40: 0.8}, "iterations": 2}),
    ("localsgd", 32, {"network": "ib4", "localsgd_period": 2, "iterations": 3}),
    ("slowmo-jitter", 24, {"network": "ib4", "slowmo_period": 2, "jitter": 0.05,
                           "iterations": 2}),
    ("groups", 32, {"network": "ib8", "groups": 4, "jitter": 0.02}),
    ("shared-nic", 32, {"network": "ib8", "groups": 2, "shared_nic": True}),
    ("uneven", 8, {"uneven": {1: 1, 5: 0}, "iterations": 2}),
    ("contention", 16, {"network": "ib8-contention"}),
    ("defaults-ib8", 16, {"network": "ib8", "defaults": True}),
    ("defaults-dgx-a100", 16, {"network": "dgx-a100", "defaults": True,
                               "bucket_cap_mb": 0.01}),
]
# the mechanisms on by default since, off for the configurations pinned before them
PLAIN = {"protocol_latency": False, "gpu_contention": "off"}


def networks() -> dict[str, Any]:
    from simddp import Contention, Network
    return {"100gbe": Network.preset("100gbe"), "ib8": Network.preset("ib-ndr", gpus_per_node=8),
            "ib4": Network.preset("ib-ndr", gpus_per_node=4),
            "ib8-contention": Network.preset("ib-ndr", gpus_per_node=8).with_(
                contention=Contention(slowdown=1.2, per_collective_us=5.0)),
            "dgx-a100": Network.preset("dgx-a100")}


def replay_kwargs(knobs: dict[str, Any]) -> dict[str, Any]:
    kw = dict(knobs)
    if not kw.pop("defaults", False):
        kw.update(PLAIN)
    kw["network"] = networks()[kw.get("network", "100gbe")]
    for k in ("rank_speed", "uneven"):
        if k in kw:
            kw[k] = {int(r): v for r, v in kw[k].items()}
    return kw


def figures(res: Any) -> dict[str, Any]:
    h = lambda x: float(x).hex()  # noqa: E731
    tl = res.timeline
    out = {"iteration_times": [h(x) for x in res.iteration_times],
           "exposed_comm": [h(x) for x in res.exposed_comm],
           "collectives": [[c["op"], c["bytes"], h(c["start"]), h(c["end"])]
                           for c in res.collectives[:64]],
           "ncollectives": len(res.collectives)}
    out["windows"] = [[[h(a), h(b)] for a, b in tl.windows(r)]
                      for r in sorted({0, 1, res.world_size - 1})]
    out["waits"] = [h(x) for x in tl.waits()]
    return out


def engines_for(knobs: dict[str, Any]) -> list[str]:
    if knobs.get("uneven") or knobs.get("network") in ("ib8-contention", "dgx-a100") or (
            knobs.get("shared_nic") and knobs.get("groups", 1) > 1):
        return ["simpy"]
    return ["simpy", "vector"]


def captures() -> dict[str, Any]:
    from fakepg import zoo
    from simddp import Compute, Network, Timing
    from simddp import capture
    timing = Timing(network=Network.preset("100gbe"), compute=Compute.roofline("a100"))
    out = {}
    for name in sorted(zoo.SCENARIOS):
        out[name] = capture(zoo.get(name), 2, timing=timing, seed=0)
    return out


def generate(old: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every result; with ``old`` (the file as it is), only those it lacks, on its captures."""
    from simddp.replay import CapturedIteration, replay
    data: dict[str, Any] = {"captures": {}, "configs": CONFIGS, "results": {}}
    caps = captures() if old is None else {
        n: CapturedIteration.from_dict(d) for n, d in old["captures"].items()}
    if old is not None:
        data["results"].update(old["results"])
    for name, cap in caps.items():
        data["captures"][name] = cap.to_dict() if old is None else old["captures"][name]
        for cid, world, knobs in CONFIGS:
            if old is not None and any(k.startswith(f"{name}/{cid}/") for k in old["results"]):
                continue
            if knobs.get("uneven") and world > 8:
                continue
            for engine in engines_for(knobs):
                try:
                    res = replay(cap, world, engine=engine, progress=False,
                                 **replay_kwargs(knobs))
                except (ValueError, RuntimeError) as e:  # a refusal, or the old Join deadlock
                    data["results"][f"{name}/{cid}/{engine}"] = {"error": type(e).__name__}
                    continue
                data["results"][f"{name}/{cid}/{engine}"] = figures(res)
    return data


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    old = None
    if "--add" in sys.argv[1:]:
        with open(PATH) as f:
            old = json.load(f)
    d = generate(old)
    with open(PATH, "w") as f:
        json.dump(d, f, sort_keys=True, indent=0)
    print(f"wrote {PATH}: {len(d['captures'])} captures, {len(d['results'])} results")
