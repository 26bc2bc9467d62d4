"""Command line: ``python train.py <command> ...`` (``python train.py --help`` lists the commands).

    python train.py fit     --config configs/warmup.yaml        # Stage 0: warm-up
    python train.py fit     --config configs/build_proxy.yaml   # Stage 1 (IPSVDCallback) + Stage 2 (alignment)
    python train.py predict --config configs/score.yaml         # influence scores -> Parquet
    python train.py select  --config configs/select.yaml        # top-k subset -> JSONL
    python train.py fit     --config configs/finetune.yaml      # fine-tune the target on the subset
    python train.py test    --config configs/evaluate.yaml      # MMLU / BBH / TyDiQA
    python train.py pipeline                                    # everything, on the built-in data

``fit/validate/test/predict`` go to LightningCLI (:mod:`iprox_lightning.commands.lightning`); every
other command is a function in :mod:`iprox_lightning.commands` parsed by jsonargparse.
"""
from __future__ import annotations

import errno
import os
import select
import signal
import sys

from .commands import COMMANDS, TRAINER_COMMANDS, command, summary
from .errors import UserError


def usage() -> str:
    """The top-level help: every command with one line saying what it does."""
    rows = list(TRAINER_COMMANDS.items()) + [(name, summary(name)) for name in COMMANDS]
    width = max(len(name) for name, _ in rows)
    lines = ["usage: python train.py <command> [--config FILE ...] [options]", "",
             "IProX: influence-preserving proxies for gradient-based data selection.", "",
             "Lightning commands (one LightningModule / LightningDataModule per config):"]
    lines += [f"  {name:<{width}}  {text}" for name, text in rows[:len(TRAINER_COMMANDS)]]
    lines += ["", "IProX commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in rows[len(TRAINER_COMMANDS):]]
    lines += ["", "python train.py <command> --help shows a command's options; --print_config its full config;",
              "--debug (anywhere) shows the traceback of an error otherwise reported in one line."]
    return "\n".join(lines)


from .errors import DEBUG_FLAG, debug_requested  # noqa: E402  (anywhere on the command line, or IPROX_DEBUG=1:
# errors the command line answers in one line (one_line_errors) keep their traceback)


def one_line_errors(command_line: bool = True) -> tuple[type[BaseException], ...]:
    """Errors that are about the user's input, not the code, whose message says everything: printed as
    ``error: <message>`` on stderr (exit status 2) instead of a traceback. On the process's command line
    (``python train.py ...``, ``iprox ...``): every :class:`~iprox_lightning.errors.UserError` — what the project's own
    input checks raise (a bad pool or validation row, a missing file, a store or score table of other inputs, a bad
    option), the formats' errors and a hub id that cannot be reached. From Python (``main([...])``, ``command_line``
    false) only the unreachable hub id (:class:`~iprox_lightning.models.hub.SourceUnreachable`); the others are raised
    to the caller. Any other error (a bug, a library's own error) keeps its traceback."""
    from .models.hub import SourceUnreachable  # lazy: --help (models.hub loads socket; train.py --help needs none)

    return (UserError,) if command_line else (SourceUnreachable,)


def main(args: list[str] | None = None):
    """Run ``python train.py <command> ...``: the process's command line (``args`` None), or ``args`` from Python."""
    argv = list(sys.argv[1:] if args is None else args)
    debug = debug_requested(argv)
    argv = [a for a in argv if a != DEBUG_FLAG]
    interrupted = _watch_ctrl_c() if args is None else None
    try:
        return _run(argv, args)
    except one_line_errors(command_line=args is None) as e:
        if debug:
            raise
        sys.stderr.write(f"error: {e} (--debug shows the traceback)\n")  # one write: ranks' lines do not interleave
        raise SystemExit(2) from None
    except BrokenPipeError:
        if debug or args is not None or not _stdout_closed():  # another pipe (a socket, a child's): not ours
            raise
        _output_closed()
        raise SystemExit(1) from None
    except OSError as e:
        full = disk_full_message(e)
        if full is None or debug or args is not None:
            raise
        print(f"error: {full} (--debug shows the traceback)", file=sys.stderr)
        raise SystemExit(1) from None
    except (KeyboardInterrupt, SystemExit, Exception) as e:
        stop = _stop_signal(e, interrupted)
        if stop is None or debug or args is not None:  # from Python the caller gets the exception itself
            raise
        print(f"stopped ({stop[0]}): the finished stages, shards and checkpoints written so far are kept; run the same "
              "command again to resume", file=sys.stderr)
        raise SystemExit(stop[1]) from None


def _stdout_closed() -> bool:
    """Whether the reader of stdout is gone (a pipe whose other end is closed reports an error to ``poll``)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no file descriptor, no poll
        return False


def _output_closed() -> None:
    """The reader of our output went away (``train.py --help | head``): say nothing more, as the Python docs
    recommend for SIGPIPE: what is left to flush goes to ``os.devnull`` instead of a ``BrokenPipeError`` at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):  # no file descriptor (captured): nothing to redirect
            pass
    os.close(devnull)


def disk_full_message(e: OSError) -> str | None:
    """One line for a write the disk (or quota) refused, naming the file; ``None`` for any other ``OSError``. Every
    artifact is written to a temporary file and renamed when complete, so nothing half-written is left under its
    name: what was finished before is kept and the same command resumes once there is room."""
    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    where = f" writing {e.filename}" if e.filename else ""
    return (f"the disk is full{where} ({e.strerror}): free some space (python train.py cache lists the caches) or "
            "write elsewhere, then run the same command again; what was finished is kept")


STOP_CODES = {"Ctrl-C": 130, "SIGTERM": 143}
"""Exit codes of a run stopped by a signal (128 + the signal's number, as a shell reports them)."""


def _watch_ctrl_c() -> list[bool]:
    """Record a Ctrl-C (SIGINT) before Python turns it into ``KeyboardInterrupt`` (Lightning turns that into
    ``sys.exit(1)`` after its own clean-up, so the exit alone cannot tell it apart)."""
    seen = [False]

    def handler(signum, frame):
        seen[0] = True
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        pass
    return seen


def _stop_signal(e: BaseException, interrupted: list[bool] | None) -> tuple[str, int] | None:
    """``(what stopped the run, its exit code)`` when ``e`` is a signal's doing: Ctrl-C, or SIGTERM (Lightning's
    ``SIGTERMException`` at a safe point of a stage); ``None`` for anything else."""
    if isinstance(e, KeyboardInterrupt) or (isinstance(e, SystemExit) and e.code == 1 and interrupted and interrupted[0]):
        return "Ctrl-C", STOP_CODES["Ctrl-C"]
    if type(e).__name__ == "SIGTERMException":
        return "SIGTERM", STOP_CODES["SIGTERM"]
    return None


def _run(argv: list[str], args: list[str] | None):
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        if not argv:
            raise SystemExit(2)
        return None
    if argv[0] in COMMANDS:
        from jsonargparse import CLI  # lazy: --help (0.08 s; train.py --help needs none)

        from .commands.import_policy import opt_in_checking_parser, restricted_imports  # lazy: --help

        with restricted_imports():
            return CLI(command(argv[0]), args=argv[1:], as_positional=False, parser_class=opt_in_checking_parser())
    from .commands.lightning import run_lightning  # lazy: --help

    return run_lightning(None if args is None and argv == sys.argv[1:] else argv)


if __name__ == "__main__":  # pragma: no cover
    main()
