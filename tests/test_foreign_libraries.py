"""Training stacks nobody here wrote, under `fakerun`, against torchrun + real gloo.

accelerate, Lightning and HuggingFace's Trainer (on accelerate) keep process-wide singletons (accelerate's Borg states, Lightning's
``rank_zero_only.rank``); with ranks as threads each rank must still see its own, or every
rank believes it is rank 0 and reads the same data shard, silently.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

ACCELERATE = '''
import hashlib, os, torch
from accelerate import Accelerator
acc = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
g = torch.Generator().manual_seed(0)
ds = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
dl = torch.utils.data.DataLoader(ds, batch_size=8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt, dl = acc.prepare(model, opt, dl)
first = None
for x, y in dl:
    if first is None:
        first = round(float(x.sum()), 4)
    opt.zero_grad(); acc.backward(torch.nn.functional.mse_loss(model(x), y)); opt.step()
w = torch.cat([p.detach().flatten() for p in model.parameters()])
with open(f"result-{os.environ['RANK']}.txt", "w") as f:
    f.write(f"{acc.process_index} {acc.is_main_process} {first} "
            f"{hashlib.md5(w.numpy().tobytes()).hexdigest()}")
acc.end_training()  # destroys the process group
'''

LIGHTNING = '''
import hashlib, os, torch, lightning as L
from lightning.pytorch.utilities import rank_zero_only

class M(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    def training_step(self, b, i):
        x, y = b
        return torch.nn.functional.mse_loss(self.l(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

def main():  # guarded: ddp_spawn starts its ranks with torch.multiprocessing (spawn)
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    L.seed_everything(0, verbose=False)
    t = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    m = M()
    t.fit(m, torch.utils.data.DataLoader(ds, batch_size=8))
    w = torch.cat([p.detach().flatten() for p in m.parameters()])
    with open(f"result-{os.environ.get('RANK', 'main')}.txt", "w") as f:
        f.write(f"{t.global_rank} {rank_zero_only.rank} {type(t.strategy.cluster_environment).__name__} "
                f"{t.global_step} {hashlib.md5(w.numpy().tobytes()).hexdigest()}")

if __name__ == "__main__":
    main()
'''

TRANSFORMERS = '''
import hashlib, os, torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.x = torch.randint(128, (64, 16), generator=torch.Generator().manual_seed(1234))
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}

set_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2))
args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, max_steps=6,
                         learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True,
                         ddp_backend="gloo", seed=0, disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=Tokens())
loss = trainer.train().training_loss
w = b"".join(v.detach().numpy().tobytes() for _, v in sorted(model.state_dict().items()))
with open(f"result-{os.environ['RANK']}.txt", "w") as f:
    f.write(f"{trainer.args.process_index} {trainer.is_world_process_zero()} {loss!r} "
            f"{hashlib.md5(w).hexdigest()}")
'''


# Real gloo processes that exit without destroy_process_group sometimes abort at interpreter
# exit ("terminate called without an active exception", SIGABRT) — after the script's work is
# done, in gloo's threads. That is the reference failing, not the code under test: a real run
# that dies that way is run again (at most 3 times).
_GLOO_EXIT_ABORT = "terminate called without an active exception"


def run(cmd: list[str], tmp_path, real: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    for attempt in range(3 if real else 1):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env=env)
        if proc.returncode == 0 or _GLOO_EXIT_ABORT not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-3000:]


def launch(launcher: list[str], script: str, tmp_path) -> list[list[str]]:
    path = tmp_path / "train.py"
    path.write_text(script)
    run([sys.executable, "-m", *launcher, "--nproc-per-node", "2", str(path)], tmp_path,
        real=launcher[0] == "torch.distributed.run")
    rows = []
    for rank in (0, 1):  # each rank writes its own file: two processes' stdout may interleave
        result = tmp_path / f"result-{rank}.txt"
        rows.append(result.read_text().split())
        result.unlink()
    return rows


def test_accelerate_ranks_under_fakerun_have_their_own_index_and_data_shard(tmp_path):
    (r0, r1) = launch(["fakepg.launch.fakerun"], ACCELERATE, tmp_path)
    assert r0[:2] == ["0", "True"] and r1[:2] == ["1", "False"]
    assert r0[2] != r1[2]  # each rank reads its own shard of the data
    assert r0[3] == r1[3]  # and the replicas agree


def test_lightning_ranks_under_fakerun_each_have_their_rank_zero_only_rank(tmp_path):
    (r0, r1) = launch(["fakepg.launch.fakerun"], LIGHTNING, tmp_path)
    assert [r0[:4], r1[:4]] == [["0", "0", "TorchElasticEnvironment", "8"],
                                ["1", "1", "TorchElasticEnvironment", "8"]]
    assert r0[4] == r1[4]


@pytest.mark.gloo
@pytest.mark.parametrize("script", [ACCELERATE, LIGHTNING, TRANSFORMERS],
                         ids=["accelerate", "lightning", "transformers-trainer"])
def test_fakerun_gives_each_rank_what_torchrun_with_real_gloo_gives_it(script, tmp_path):
    real = launch(["torch.distributed.run"], script, tmp_path)
    assert launch(["fakepg.launch.fakerun"], script, tmp_path) == real
    assert launch(["fakepg.launch.fakerun", "--isolation", "process"], script, tmp_path) == real


LIGHTNING_SPAWN = LIGHTNING.replace('strategy="ddp"', 'strategy="ddp_spawn"')


@pytest.mark.gloo
def test_lightning_ddp_spawn_under_fakerun_isolation_process_trains_as_real_spawned_gloo(tmp_path):
    """ddp_spawn calls torch.multiprocessing.spawn: in a rank process that starts a fake world
    of 2 ranks instead of 2 real gloo processes; the weights the main process gets back agree."""
    path = tmp_path / "train.py"
    path.write_text(LIGHTNING_SPAWN)
    results = []
    for cmd, real in (([sys.executable, str(path)], True),
                      ([sys.executable, "-m", "fakepg.launch.fakerun", "--isolation", "process",
                        "--nproc-per-node", "1", str(path)], False)):
        run(cmd, tmp_path, real)
        results.append((tmp_path / "result-main.txt").read_text().split())
    real, fake = results
    assert fake == real


DEEPSPEED = '''
import hashlib, os, torch, deepspeed
import deepspeed.comm.torch
# Its CPU shared-memory op serves inference all_reduce only; JIT-building it takes minutes.
deepspeed.comm.torch.build_shm_op = lambda: None
rows = []
for stage in (1, 2):  # one launch trains both stages (each launch costs seconds of imports)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 64,
                                    "allgather_bucket_size": 64},
              "steps_per_print": 10**6}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    g = torch.Generator().manual_seed(100 + engine.global_rank)
    losses = []
    for _ in range(4):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    w = b"".join(p.detach().numpy().tobytes() for p in engine.module.parameters())
    rows.append(f"{engine.global_rank} {engine.world_size} zero{stage} {losses} "
                f"{hashlib.md5(w).hexdigest()}")
with open(f"result-{os.environ['RANK']}.txt", "w") as f:
    f.write(" ".join(rows))
'''


@pytest.mark.gloo
def test_deepspeed_zero_1_and_2_under_thread_mode_fakerun_train_as_under_torchrun(tmp_path):
    """DeepSpeed keeps its backend and groups in module globals (fakepg.world.isolation declares
    them per rank): in threads every rank used rank 0's world group before."""
    pytest.importorskip("deepspeed")
    real = launch(["torch.distributed.run"], DEEPSPEED, tmp_path)
    assert [row[:3] for row in real] == [["0", "2", "zero1"], ["1", "2", "zero1"]]
    assert sum(tok == "zero2" for tok in real[0]) == 1
    assert launch(["fakepg.launch.fakerun"], DEEPSPEED, tmp_path) == real


def test_torchft_manager_fails_at_once_naming_its_native_store_wait_in_both_modes():
    """torchft's Manager connects a native TCPStore client (bound at import) to the world's
    store and runs its quorum in Rust over gRPC: neither can reach the fake world. Before, it
    hung in thread mode and timed out after 64 s in process mode, with no hint."""
    pytest.importorskip("torchft")
    import datetime

    import fakepg
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    limit = datetime.timedelta(seconds=60)

    def train(rank):
        model = torch.nn.Linear(4, 2)
        Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=model.load_state_dict,
                state_dict=model.state_dict, replica_id="r0", lighthouse_addr=lighthouse.address(),
                rank=rank, world_size=2, store_addr="127.0.0.1", store_port=29500,
                use_async_quorum=False, timeout=limit, quorum_timeout=limit, connect_timeout=limit)

    try:
        for isolation in ("thread", "process"):
            with pytest.raises(fakepg.RankFailedError) as info:
                fakepg.spawn(train, nprocs=2, isolation=isolation, timeout=50)
            assert isinstance(info.value.__cause__, fakepg.NativeWaitError)
            assert "(via torchft/manager.py:" in str(info.value.__cause__)
            assert "--isolation process alike" in str(info.value.__cause__)
    finally:
        lighthouse.shutdown()


TORCHFT = '''
import hashlib, os
from datetime import timedelta
import torch
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=20)), min_replica_size=1,
                  load_state_dict=lambda sd: model.load_state_dict(sd),
                  state_dict=lambda: model.state_dict(), replica_id="ft_0",
                  timeout=timedelta(seconds=20))
ddp, optimizer = DistributedDataParallel(manager, model), Optimizer(manager, opt)
torch.manual_seed(1 + int(os.environ["RANK"]))
losses = []
for _ in range(3):
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    optimizer.step()
    losses.append(round(loss.item(), 5))
step = manager.current_step()
manager.shutdown()
w = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
with open(f"result-{os.environ['RANK']}.txt", "w") as f:
    f.write(f"{step} {losses} {hashlib.md5(w).hexdigest()}")
'''


@pytest.mark.gloo
@pytest.mark.slow
def test_torchft_ddp_with_a_lighthouse_trains_under_process_mode_fakerun_as_under_torchrun(
        tmp_path, monkeypatch):
    """torchft's should_commit and quorum wait in Rust (gRPC) for every rank of the replica
    group to call in: as processes the waiting rank's proxy lends the baton, so the other
    rank runs, as under torchrun (before: rank 1 held it until torchft's timeout, 89 s, and
    the run failed). In threads its quorum thread needs the world's store, which only rank
    threads reach: the run fails at once, naming the wait and the way out."""
    pytest.importorskip("torchft")
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse.address())
    try:
        real = launch(["torch.distributed.run"], TORCHFT, tmp_path)
        assert [row[0] for row in real] == ["3", "3"]  # three committed steps per rank
        assert launch(["fakepg.launch.fakerun", "--isolation", "process"], TORCHFT, tmp_path) == real
        proc = subprocess.run([sys.executable, "-m", "fakepg.launch.fakerun", "--nproc-per-node",
                               "2", str(tmp_path / "train.py")], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)
        assert proc.returncode == 1
        # The quorum thread waits in Rust for the lighthouse, which holds the quorum for
        # seconds while the process-mode run's replica still heartbeats: the world waits for
        # it (before, a false hang verdict after 1 s, then the real client's 20 s timeout).
        assert re.search(r"NativeWaitError: rank [01]: torchft/process_group.py:\d+ builds "
                         r"a TCPStore client", proc.stderr), proc.stderr[-3000:]
        assert "on a thread the program started" in proc.stderr
        assert "fakerun --isolation process" in proc.stderr
        assert "DistNetworkError" not in proc.stderr and "hang detected" not in proc.stderr
    finally:
        lighthouse.shutdown()
