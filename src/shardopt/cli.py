"""The ``shardopt`` command: builds configs, calls the library, prints results.

User mistakes (bad flags, missing paths, files that are not checkpoints, checkpoints that do not fit
the model) end with one ``shardopt: error: ...`` line on stderr and a non-zero exit status; anything
else is a bug and keeps its traceback.

Exit status: 0 success; 1 training failed, or a checkpoint failed the library's checks (``verify``,
or a damaged checkpoint found while loading, also inside the ranks); 2 a usage error (flags, paths,
a resume source that is not a checkpoint of ``shardopt train``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, NoReturn

from shardopt.recipes.launch import WorkerFailed

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a job stopped by Ctrl-C


class CommandLineError(Exception):
    """A mistake in the command line; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        raise CommandLineError(f"{message} (see `{self.prog} --help`)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from shardopt.checkpoint.config import SNAPSHOTS
    from shardopt.recipes.model import PRESETS

    parser = _Parser(
        prog="shardopt",
        description="Sharded AdamW (ZeRO-1/2) for PyTorch with exact, reshardable, pickle-free "
        "checkpoints: train the reference job, and inspect, verify and export checkpoints.",
        epilog="examples:\n"
        "  shardopt demo\n"
        "  shardopt train --nproc 2 --steps 200 --ckpt-dir ckpt --save-every 50\n"
        "  shardopt train --nproc 3 --steps 200 --ckpt-dir ckpt --resume --low-memory-resume\n"
        "  torchrun --nproc-per-node 8 -m shardopt train --device cuda --preset 1b --ckpt-dir ckpt\n"
        "  shardopt inspect ckpt; shardopt verify ckpt; shardopt export ckpt exported/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shardopt {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    t = sub.add_parser("train", help="train the reference GPT with checkpointing (spawns its own ranks)",
                       description="Train the reference GPT on a synthetic task. Spawns --nproc ranks "
                       "(gloo on CPU, NCCL with --device cuda); under torchrun it joins the given job.")
    t.add_argument("--nproc", type=_positive_int, default=None,
                   help="ranks to spawn (default: 2 on CPU, every visible GPU with --device cuda); "
                   "ignored under torchrun")
    t.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo, one thread per rank unless OMP_NUM_THREADS is set; "
                   "cuda: NCCL, GPU LOCAL_RANK per rank (default: cpu)")
    # Hyperparameter flags default to None so that a resume can tell the ones given (which
    # override the checkpoint's) from the ones not given (which keep the checkpoint's).
    t.add_argument("--preset", choices=tuple(PRESETS), default=None, help="model size (default: tiny)")
    t.add_argument("--steps", type=_positive_int, default=None,
                   help="total optimizer steps (default: 100)")
    t.add_argument("--stop-at", type=_positive_int, default=None, metavar="STEP",
                   help="stop after STEP as if interrupted; the LR schedule still spans --steps")
    t.add_argument("--batch-size", type=_positive_int, default=None,
                   help="global batch in sequences per step, split over ranks (default: 12)")
    t.add_argument("--micro-batch-size", type=_positive_int, default=None,
                   help="sequences per forward/backward on one rank (default: the rank's whole batch)")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 3e-3)")
    t.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of --steps")
    t.add_argument("--seed", type=int, default=None,
                   help="seeds the weights and the data (default: 0)")
    t.add_argument("--ckpt-dir", default=None, help="checkpoint root directory")
    t.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="save every N steps and at the end (default: only at the end, if --ckpt-dir)")
    t.add_argument("--keep-last", type=_positive_int, default=None, metavar="K",
                   help="keep only the K newest checkpoints")
    t.add_argument("--async-save", nargs="?", const="host", default=None,
                   choices=SNAPSHOTS, metavar="SNAPSHOT",
                   help="write checkpoints in the background while training goes on; SNAPSHOT: "
                   "where the state is copied (host, the only kind: see docs/async_save.md)")
    t.add_argument("--resume", nargs="?", const=True, default=False, metavar="PATH",
                   help="resume from the latest checkpoint in --ckpt-dir (fresh start if there is none), "
                   "or from PATH (a checkpoint or a root); --preset, --steps, --batch-size, --lr, "
                   "--warmup-steps and --seed not given keep the checkpoint's values, given ones "
                   "override them")
    t.add_argument("--low-memory-resume", action="store_true",
                   help="keep loaded Adam moments on the host until the first step")
    t.add_argument("--log-file", default=None, help="per-step metrics as JSON lines (rank 0)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")

    i = sub.add_parser("inspect", help="show a checkpoint's step, DP size and per-param state")
    i.add_argument("path", help="checkpoint directory, or a root (its latest checkpoint)")
    i.add_argument("--json", action="store_true", help="machine-readable output")

    v = sub.add_parser("verify", help="check a checkpoint's completeness and every content hash")
    v.add_argument("path", help="checkpoint directory, or a root (its latest checkpoint)")

    e = sub.add_parser("export", help="write consolidated model/optimizer safetensors")
    e.add_argument("path", help="checkpoint directory, or a root (its latest checkpoint)")
    e.add_argument("out", help="output directory")
    e.add_argument("--moments-dtype", choices=("float32", "stored"), default="float32",
                   help="Adam moments in fp32 (default) or as stored: bf16, or int8 codes with "
                        "their fp32 scales as '<fqn>.exp_avg.scale'")

    d = sub.add_parser("demo", help="train on 2 CPU ranks, kill, resume on 3, compare with a clean run",
                       description="Train the tiny preset on 2 CPU ranks and SIGKILL the job while it "
                       "writes a checkpoint, resume from the latest committed one with "
                       "--low-memory-resume on 3 ranks, run the same job uninterrupted, then compare the "
                       "loss curves and plot them (about a minute on 2 cores).")
    d.add_argument("--out", default="demo_out", help="output directory (default: demo_out)")
    return parser


def _version() -> str:
    from shardopt import __version__

    return __version__


def _existing(path: str) -> str:
    if not os.path.exists(path):
        raise CommandLineError(f"no such file or directory: {path}")
    return path


# ----------------------------------------------------------------------------- train
def cmd_train(args: argparse.Namespace) -> int:
    from shardopt import checkpoint
    from shardopt.recipes.launch import launch, under_torchrun
    from shardopt.recipes.paths import check_paths
    from shardopt.recipes.train import TrainConfig, run

    if args.low_memory_resume and not args.resume:
        raise CommandLineError("--low-memory-resume needs --resume")
    # Mistakes found here cost one line; found in the ranks, they cost a launch.
    try:
        settings, notes = _hyperparameters(args)
        cfg = TrainConfig(
            **settings, stop_at=args.stop_at, micro_batch_size=args.micro_batch_size,
            device=args.device, ckpt_dir=args.ckpt_dir, save_every=args.save_every,
            keep_last=args.keep_last, async_save=args.async_save is not None,
            async_snapshot=args.async_save or "host",
            low_memory_resume=args.low_memory_resume,
            log_file=args.log_file, progress=not args.no_progress,
        )
    except checkpoint.FormatError:
        raise  # a damaged checkpoint to resume from: exit 1, as `verify` of it
    except ValueError as exc:
        raise CommandLineError(str(exc)) from None
    nproc = args.nproc or _default_nproc(args.device)
    if not under_torchrun() and cfg.batch_size % nproc:
        raise CommandLineError(f"--batch-size {cfg.batch_size} does not split evenly over --nproc {nproc}")
    try:
        check_paths(cfg)  # last: it creates the log file and checkpoint root
    except ValueError as exc:
        raise CommandLineError(str(exc)) from None
    if os.environ.get("RANK", "0") == "0":
        for note in notes:
            print(f"[shardopt] note: {note}", file=sys.stderr)
    launch(run, cfg, nproc=nproc)
    return 0


# Flags a resume takes from the checkpoint unless given: TrainConfig field -> flag.
_HYPERPARAMETER_FLAGS = {"preset": "--preset", "steps": "--steps", "batch_size": "--batch-size",
                         "lr": "--lr", "warmup_steps": "--warmup-steps", "seed": "--seed"}


def _hyperparameters(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The hyperparameters and resume source of a ``train`` command, and a note for each flag
    that overrides a value the checkpoint was saved with.

    A resume takes the checkpoint's value for every hyperparameter flag not given; a fresh run
    takes :class:`TrainConfig`'s defaults. ``--preset`` must match the checkpoint's model.
    """
    from shardopt import checkpoint
    from shardopt.recipes.train import TrainConfig, saved_hyperparameters

    given = {f: getattr(args, f) for f in _HYPERPARAMETER_FLAGS if getattr(args, f) is not None}
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in _HYPERPARAMETER_FLAGS}
    resume, saved, notes = args.resume, {}, []
    if not resume and args.ckpt_dir is not None and checkpoint.latest(args.ckpt_dir):
        raise CommandLineError(f"--ckpt-dir {args.ckpt_dir} holds checkpoints (the latest: "
                         f"{checkpoint.latest(args.ckpt_dir)}): pass --resume to continue from "
                         "it, or give another --ckpt-dir; a fresh run's saves would replace "
                         "them")
    if resume is True and args.ckpt_dir is not None:
        resume = checkpoint.latest(args.ckpt_dir) or True  # True: none yet, the run starts fresh
    if isinstance(resume, str):
        _existing(resume)
        try:
            info = checkpoint.inspect(resume)
            saved = saved_hyperparameters(info["extra"], info["path"])
        except checkpoint.FormatError:
            raise  # a damaged checkpoint: exit 1 as for `verify`, not a command-line mistake
        except ValueError as exc:  # nothing committed there, or not this job's checkpoint
            raise CommandLineError(f"--resume {resume}: {exc}") from None
        resume = info["path"]  # the ranks load the checkpoint read here, even if a newer one lands
    if "preset" in given and saved.get("preset", given["preset"]) != given["preset"]:
        raise CommandLineError(f"--preset {given['preset']} does not fit the checkpoint {resume}, "
                         f"saved from the {saved['preset']} preset")
    for field, value in given.items():
        if field in saved and saved[field] != value:
            notes.append(f"{_HYPERPARAMETER_FLAGS[field]} {value} overrides the checkpoint's "
                         f"{saved[field]}")
    return {**defaults, **saved, **given, "resume": resume}, notes


def _default_nproc(device: str) -> int:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise CommandLineError("--device cuda was given but CUDA is not available")
        return torch.cuda.device_count()
    return 2


# -------------------------------------------------------------- inspect/verify/export
def cmd_inspect(args: argparse.Namespace) -> int:
    from shardopt import checkpoint

    info = checkpoint.inspect(_existing(args.path))
    if args.json:
        json.dump(info, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print_inspect(info)
    return 0


def print_inspect(info: dict[str, Any]) -> None:
    params = info["params"]
    weight_bytes = sum(p["weight_bytes"] for p in params)
    state_bytes = sum(p["state_bytes"] for p in params)
    print(f"checkpoint  {info['path']}")
    print(f"step        {info['step']}")
    print(f"dp size     {info['dp_size']} (at save; loads into any DP size)")
    print(f"format      v{info['format_version']}, created {info.get('created') or '?'}")
    print(f"params      {info['num_params']} tensors, {info['numel']:,} elements "
          f"({info['numel_trainable']:,} trainable)")
    print(f"weights     {_human(weight_bytes)}")
    moments = ", ".join(f"{name} {_encoding(enc)}" for name, enc in info["moments"].items())
    print(f"optimizer   {_human(state_bytes)} (fp32 master, {moments})")
    print(f"on disk     {_human(info['bytes_on_disk'])} in {info['num_files']} files")
    header = ("param", "shape", "dtype", "weights", "state")
    rows = [
        (p["fqn"], "x".join(map(str, p["shape"])) or "()", str(p["dtype"]),
         _human(p["weight_bytes"]), _human(p["state_bytes"]))
        for p in sorted(params, key=lambda p: _natural_key(p["fqn"]))
    ]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    print()
    for r in [header, *rows]:
        print(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  "
              f"{r[3]:>{widths[3]}}  {r[4]:>{widths[4]}}")


def _encoding(enc: dict[str, Any]) -> str:
    if "block" not in enc:
        return enc["dtype"]
    return f"int8 ({enc['dtype']} codes of {'sqrt ' if enc['map'] == 'sqrt' else ''}x, " \
           f"fp32 scale per {enc['block']})"


def _natural_key(fqn: str) -> list[Any]:
    """Sort ``blocks.2`` before ``blocks.10``."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in fqn.split(".")]


def _human(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def cmd_verify(args: argparse.Namespace) -> int:
    from shardopt import checkpoint

    summary = checkpoint.verify(_existing(args.path))
    print(f"OK {summary['path']}: step {summary['step']}, {summary['files']} files, "
          f"{_human(summary['bytes'])}, every content hash matches")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from shardopt import checkpoint

    written = checkpoint.export(_existing(args.path), args.out,
                                moments_dtype=args.moments_dtype)
    print(f"exported {args.path} to {args.out}:")
    for path in written:
        print(f"  {path}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from shardopt.recipes.demo import main as demo_main

    return demo_main(out_dir=args.out)


COMMANDS = {"train": cmd_train, "inspect": cmd_inspect, "verify": cmd_verify, "export": cmd_export,
            "demo": cmd_demo}


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command is None:
            raise CommandLineError("a command is required: train, inspect, verify, export or demo "
                             "(see `shardopt --help`)")
        return COMMANDS[args.command](args)
    except CommandLineError as exc:
        _error(str(exc))
        return EXIT_USAGE
    except WorkerFailed as exc:
        _error(f"training failed: {exc}")
        return EXIT_FAILED
    except BrokenPipeError:
        # Output piped into `head` and the like: stop quietly, as the docs of `signal` advise.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED
    except (ValueError, OSError) as exc:
        # Library errors for user input subclass ValueError and name the file, FQN or rank.
        _error(str(exc))
        return EXIT_FAILED
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_INTERRUPTED


def _error(message: str) -> None:
    line = " ".join(message.split())  # one line, even for multi-line library messages
    print(f"shardopt: error: {line}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
