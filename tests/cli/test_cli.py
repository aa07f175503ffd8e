"""The ``shardopt`` command, run as a user runs it: in a subprocess.

One flow trains on 2 spawned ranks, resumes under ``torchrun`` on 3, then inspects, verifies and
exports the result and catches a corrupted file, also while the ranks load it. User mistakes must end
in one clear stderr line and a non-zero exit status, never a traceback, whether the command finds
them or a spawned rank does. A resume keeps the checkpoint's hyperparameters unless flags override
them. The demo's kill is a real SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import shardopt
from shardopt import checkpoint, cli
from shardopt.recipes import demo
from shardopt.recipes.demo import DemoPlan
from shardopt.recipes.launch import LaunchError, WorkerFailed, launch
from shardopt.recipes.train import TrainConfig, lr_lambda

SRC = str(Path(shardopt.__file__).resolve().parents[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC, *filter(None, [env.get("PYTHONPATH")])])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # never inherit a launcher's environment
    return env


def shardopt_cmd(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardopt", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def _one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.returncode != 0, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardopt: error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_train_resume_inspect_verify_export(tmp_path, capsys):
    ckpt, log = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    common = ["--steps", "6", "--batch-size", "6", "--ckpt-dir", str(ckpt), "--save-every", "2",
              "--log-file", str(log), "--no-progress"]

    first = _ok(shardopt_cmd("train", "--nproc", "2", "--stop-at", "3", "--async-save", *common,
                             cwd=tmp_path))
    assert first.stderr.count("preset tiny") == 1, first.stderr  # logs from rank 0 only
    assert "2 rank(s)" in first.stderr and "saved step 2" in first.stderr
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000002"]

    # Under torchrun the command joins the given job (3 ranks here) instead of spawning its own.
    resumed = _ok(subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
         "-m", "shardopt", "train", *common, "--resume", "--low-memory-resume", "--keep-last", "2"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240))
    assert "3 rank(s)" in resumed.stderr and "resumed from" in resumed.stderr
    assert "step_00000002" in resumed.stderr
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # step 3 of the killed run was dropped and redone
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000004", "step_00000006"]

    table = _ok(shardopt_cmd("inspect", str(ckpt), cwd=tmp_path)).stdout
    assert "step_00000006" in table and "dp size     3" in table
    router = next(line for line in table.splitlines() if line.startswith("blocks.1.mlp.router.weight"))
    assert router.split()[1:3] == ["2x64", "float32"]

    # The rest runs in this process: the subprocess boundary is covered above and below.
    capsys.readouterr()
    assert cli.main(["inspect", str(ckpt / "step_00000004"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["step"] == 4 and info["dp_size"] == 3
    dtypes = {p["fqn"]: p["dtype"] for p in info["params"]}
    assert dtypes["blocks.0.norm1.weight"] == "float32" and dtypes["tok_emb.weight"] == "bfloat16"

    out = tmp_path / "export"
    _ok(shardopt_cmd("export", str(ckpt), str(out), cwd=tmp_path))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        emb = f.get_tensor("tok_emb.weight")
        assert str(emb.dtype) == "torch.bfloat16" and tuple(emb.shape) == (64, 64)
    with safe_open(str(out / "optimizer.safetensors"), "pt") as f:
        moment = f.get_tensor("blocks.1.mlp.router.weight.exp_avg_sq")
        assert str(moment.dtype) == "torch.float32" and tuple(moment.shape) == (2, 64)

    assert _ok(shardopt_cmd("verify", str(ckpt), cwd=tmp_path)).stdout.startswith("OK ")
    # A flipped byte in a data file: verify names the file and fails.
    victim = sorted((ckpt / "step_00000006").glob("optim-*.safetensors"))[-1]
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert cli.main(["verify", str(ckpt)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardopt: error: ") and victim.name in err[0], err

    # The same damage found inside the ranks, while they load: one line, no rank's traceback.
    damaged = shardopt_cmd("train", "--nproc", "2", "--ckpt-dir", str(ckpt), "--resume", "--steps", "8",
                           "--no-progress", cwd=tmp_path)
    assert "Traceback" not in damaged.stderr
    assert damaged.returncode == 1
    error = [line for line in damaged.stderr.splitlines() if line.startswith("shardopt: error: ")]
    assert len(error) == 1 and victim.name in error[0], damaged.stderr


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["inspect", "{tmp}/missing"], "no such file or directory"),
        (["train", "--steps", "two"], "--steps"),
    ],
)
def test_user_mistakes_are_one_line(tmp_path, args, fragment):
    proc = shardopt_cmd(*[a.format(tmp=tmp_path) for a in args], cwd=tmp_path, timeout=120)
    assert "Traceback" not in proc.stderr
    _one_error_line(proc, fragment)


# In-process checks of the same error paths: cheap, so they cover more cases.
@pytest.mark.parametrize(
    "argv, code, fragment",
    [
        (["verify", "{tmp}"], 1, "no committed checkpoint"),
        (["export", "{tmp}/missing", "{tmp}/out"], 2, "missing"),
        (["train", "--resume", "{tmp}/missing"], 2, "missing"),
        ([], 2, "a command is required"),
        (["train", "--bogus"], 2, "unrecognized arguments: --bogus"),
        (["train", "--preset", "huge"], 2, "invalid choice"),
        (["train", "--nproc", "0"], 2, "--nproc"),
        (["train", "--low-memory-resume"], 2, "needs --resume"),
        (["train", "--nproc", "5"], 2, "does not split evenly"),
        (["train", "--steps", "4", "--stop-at", "9"], 2, "--stop-at"),
        (["train", "--resume"], 2, "needs --ckpt-dir"),
        (["train", "--keep-last", "2"], 2, "need --ckpt-dir"),
        (["export", "x"], 2, "required: out"),
        (["train", "--nproc", "-1"], 2, "--nproc"),
        (["train", "--warmup-steps", "-1"], 2, "--warmup-steps must be >= 0"),
        (["train", "--log-file", "{tmp}/dir"], 2, "--log-file {tmp}/dir is a directory"),
        (["train", "--ckpt-dir", "{tmp}/file"], 2, "--ckpt-dir {tmp}/file is not a directory"),
        (["train", "--ckpt-dir", "{tmp}/file/ckpt"], 2, "--ckpt-dir {tmp}/file/ckpt cannot be written"),
        (["train", "--resume", "{tmp}/dir"], 2, "--resume {tmp}/dir: no committed checkpoint"),
        (["train", "--ckpt-dir", "{tmp}/dir", "--resume", "{tmp}/dir/x"], 2, "no such file"),
    ],
)
def test_usage_errors(tmp_path, capsys, argv, code, fragment):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("")
    before = sorted(tmp_path.rglob("*"))
    assert cli.main([a.format(tmp=tmp_path) for a in argv]) == code
    err = capsys.readouterr().err.strip().splitlines()
    fragment = fragment.format(tmp=tmp_path)
    assert len(err) == 1 and err[0].startswith("shardopt: error: ") and fragment in err[0], err
    assert sorted(tmp_path.rglob("*")) == before  # a mistake creates nothing


def test_resume_of_a_checkpoint_not_written_by_train(tmp_path, capsys):
    model = torch.nn.Linear(4, 4)
    opt = shardopt.DistributedOptimizer(model, shardopt.OptimizerConfig(lr=1e-3))
    path = checkpoint.save(tmp_path / "ckpt", model, opt, step=1, extra={"data_pos": 3})
    assert cli.main(["train", "--ckpt-dir", str(tmp_path / "ckpt"), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was not written by `shardopt train`" in err[0] and str(path) in err[0], err


def test_resume_of_a_damaged_checkpoint_fails_as_verify_does(tmp_path, capsys):
    """A damaged manifest is no command-line mistake: exit 1, as `verify` of it, not 2."""
    model = torch.nn.Linear(4, 4)
    opt = shardopt.DistributedOptimizer(model, shardopt.OptimizerConfig(lr=1e-3))
    path = Path(checkpoint.save(tmp_path / "ckpt", model, opt, step=1))
    (path / "manifest.json").write_text("{garbage")
    assert cli.main(["verify", str(path)]) == 1
    capsys.readouterr()
    assert cli.main(["train", "--ckpt-dir", str(tmp_path / "ckpt"), "--resume", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardopt: error: ") and "manifest" in err[0], err


@pytest.fixture
def keep_torch_threads():
    # A one-rank `train` runs in this process and sets torch's thread count as a rank does.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_resume_keeps_saved_hyperparameters_unless_given(tmp_path, capsys, keep_torch_threads):
    ckpt, log = str(tmp_path / "ckpt"), tmp_path / "metrics.jsonl"
    common = ["train", "--nproc", "1", "--ckpt-dir", ckpt, "--log-file", str(log), "--no-progress"]
    assert cli.main([*common, "--steps", "6", "--batch-size", "4", "--lr", "2e-3", "--warmup-steps", "2",
                     "--save-every", "3", "--stop-at", "4"]) == 0
    capsys.readouterr()

    assert cli.main([*common, "--resume", "--preset", "small"]) == 2
    assert "--preset small does not fit" in capsys.readouterr().err

    # Given: --lr (overrides, with a note) and --seed (the same value: no note). The rest, not
    # given, keep the checkpoint's values, not the flags' defaults (100 steps, batch 12, 3e-3).
    assert cli.main([*common, "--resume", "--lr", "1e-3", "--seed", "0"]) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "note:" in line]
    assert notes == ["[shardopt] note: --lr 0.001 overrides the checkpoint's 0.002"], err
    assert "global batch 4 x" in err
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    schedule = lr_lambda(TrainConfig(steps=6, warmup_steps=2))
    assert [r["lr"] for r in rows[:3]] == [2e-3 * schedule(e) for e in range(3)]
    assert [r["lr"] for r in rows[3:]] == [1e-3 * schedule(e) for e in range(3, 6)]
    saved = checkpoint.inspect(ckpt)["extra"]
    assert saved["train"] == {"preset": "tiny", "steps": 6, "lr": 1e-3, "warmup_steps": 2}
    assert saved["data"]["global_batch_size"] == 4


def _fail(kind: str) -> None:
    """One rank of :func:`test_launch_reports`'s jobs (module level: it is pickled to the ranks)."""
    rank = int(os.environ["RANK"])
    if kind == "user error on rank 0" and rank == 0:
        raise ValueError("the input on rank 0 is wrong")
    if rank == 1:
        time.sleep(0.5 if kind == "user error on rank 0" else 0)  # as a peer that loses rank 0
        raise RuntimeError("rank 1 crashed")


@pytest.mark.parametrize("kind", ["user error on rank 0", "bug on rank 1"])
def test_launch_reports(kind, capfd):
    with pytest.raises((LaunchError, WorkerFailed)) as failure:
        launch(_fail, kind, nproc=2)
    err = capfd.readouterr().err
    if kind == "user error on rank 0":
        # The user error wins; the peer's crash that follows from it is not shown.
        assert failure.type is LaunchError and str(failure.value) == "the input on rank 0 is wrong"
        assert "Traceback" not in err and "rank 1 crashed" not in err
    else:
        assert failure.type is WorkerFailed
        assert str(failure.value) == "rank 1 exited with code 1 (tracebacks above)"
        assert err.count("Traceback") == 1 and "[rank 1] Traceback" in err
        assert "RuntimeError: rank 1 crashed" in err


def _killed() -> None:
    """Rank 1 of :func:`test_a_killed_rank_is_named_with_its_signal`'s job dies of SIGKILL."""
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)  # rank 0 is stopped with the job


def test_a_killed_rank_is_named_with_its_signal():
    """A rank killed by a signal is named with it; one that exits with a code, with that
    (:func:`test_launch_reports`)."""
    with pytest.raises(WorkerFailed, match=r"^rank 1 was killed by SIGKILL$"):
        launch(_killed, nproc=2)


def test_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "manifest.json").write_text("{not json")
    assert cli.main(["inspect", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "manifest.json" in err[0], err


def test_demo_kills_the_job_while_it_saves(tmp_path, monkeypatch, capsys):
    # The demo's first phase (its comparison runs the same `train` commands the tests above run).
    monkeypatch.setattr(os, "environ", _env())  # the `shardopt train` command inherits it
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.jsonl"
    # 40 steps: slack for a loaded machine, where the kill may land a few steps late.
    args = ["--steps", "40", "--batch-size", "6", "--nproc", "2", "--ckpt-dir", str(ckpt),
            "--save-every", "2", "--log-file", str(log), "--no-progress"]
    demo._train_and_kill(args, log, ckpt, kill_at=4)  # raises unless SIGKILL ended the job
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps[:4] == [1, 2, 3, 4] and len(steps) < 40
    capsys.readouterr()
    latest, step = demo._describe_root(ckpt)
    # Usually 2 (the step-4 save was in flight and is lost) or 4 (it committed first); later only
    # on a machine so loaded that the kill landed late.
    assert step % 2 == 0 and 2 <= step <= max(steps), (step, steps)
    assert latest.name == f"step_{step:08d}"
    assert f"latest -> {latest.name}" in capsys.readouterr().out


def test_demo_plan_kills_during_a_later_save():
    with pytest.raises(ValueError, match="kill_at"):
        DemoPlan(steps=8, save_every=2, kill_at=2)
    with pytest.raises(ValueError, match="kill_at"):
        DemoPlan(steps=8, save_every=2, kill_at=5)


def test_demo_reads_only_complete_lines_of_the_log_it_watches(tmp_path):
    """The demo polls the job's log while the job appends to it: a line still being written
    is not read (it once failed the demo with 'Unterminated string')."""
    from shardopt.recipes.demo import _last_step
    log = tmp_path / "run.jsonl"
    assert _last_step(log) == 0
    log.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert _last_step(log) == 1
    log.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n')
    assert _last_step(log) == 2
    log.write_text('{"step": 1, "lo')
    assert _last_step(log) == 0


def test_a_fresh_run_into_a_checkpoint_directory_is_refused(tmp_path, capsys):
    """Without --resume a run into a --ckpt-dir that holds checkpoints would replace them
    from its first save on (a rollback): refused before anything starts."""
    model = torch.nn.Linear(4, 4)
    checkpoint.save(tmp_path / "ckpt", model,
                    shardopt.DistributedOptimizer(model, shardopt.OptimizerConfig()), step=7)
    before = sorted(tmp_path.rglob("*"))
    assert cli.main(["train", "--ckpt-dir", str(tmp_path / "ckpt"), "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds checkpoints" in err[0] and "--resume" in err[0], err
    assert sorted(tmp_path.rglob("*")) == before
