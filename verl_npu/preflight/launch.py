"""Recover the verl trainer invocation from a bash launch script without running it.

The static shell evaluator (``preflight.shell``) reads the script; this module recognises the trainer command in
it (``python -m verl.trainer.main_ppo``, also through ``$PYTHON``, ``env A=1 python ...``, functions and sourced
files). The result is the Hydra override list exactly as the trainer would receive it, the environment it would
see, and findings for launch bugs (extra arguments piped into ``tee``, unset variables, no or several trainers, a
trainer bash never reaches or reaches only by a condition preflight cannot evaluate, a key set twice by brace
expansion).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tree_sitter import Node

from verl_npu.errors import UserError
from verl_npu.preflight.flow import NO, UNKNOWN, decide
from verl_npu.preflight.shell import (
    CHAINS,
    NAME,
    Finding,
    ScriptFileError,
    StaticShell,
    Taint,
    descendants,
    join_pieces,
    node_line,
    node_text,
    read_script_file,
    scalar,
)

__all__ = ["TRAINER_MODULE", "Finding", "Launch", "LaunchError", "launch_from_overrides", "read_launch_script"]

TRAINER_MODULE = "verl.trainer.main_ppo"
_PYTHON = re.compile(r"(?:.*/)?python(?:[0-9]+(?:\.[0-9]+)?)?")


class LaunchError(UserError):
    """The launch script cannot be read."""


@dataclass(frozen=True)
class Launch:
    source: str  # script path or "<overrides>"
    module: str | None  # TRAINER_MODULE, or None when no command runs it
    config_name: str | None  # --config-name, None when absent
    overrides: tuple[str, ...]  # as the trainer receives them, without --config-name
    passthrough: tuple[str, ...]  # what "$@"/"$*" stood for; already inside overrides
    env: dict[str, str]  # the trainer's environment: the given env, exports (also `set -a`), NAME=value prefixes
    variables: dict[str, str]  # every shell variable at the trainer command (arrays joined by spaces)
    findings: tuple[Finding, ...]
    trainer_line: int | None
    config_path: str | None = None  # --config-path: the primary config directory (Hydra: relative to main_ppo.py)
    config_dir: str | None = None  # --config-dir: one more directory on the config search path
    unknowns: tuple[str, ...] = ()  # the placeholders (<$(...)>) in config_name, config_path, config_dir, overrides

    def hydra_overrides(self) -> tuple[tuple[str, ...], dict[str, str]]:
        """The overrides Hydra can compose (each placeholder a sentinel) and sentinel -> placeholder."""
        from verl_npu.preflight import unknowns

        return unknowns.for_hydra(self.overrides, self.unknowns)


# Hydra's options that name the config (hydra/_internal/utils.py get_args_parser); the last one given wins
_CONFIG_OPTIONS = {"--config-name": 0, "-cn": 0, "--config-path": 1, "-cp": 1, "--config-dir": 2, "-cd": 2}


def _split_config(words: Sequence[str]) -> tuple[tuple[str | None, str | None, str | None], tuple[str, ...]]:
    """((config name, config path, config dir), the overrides): every word that is no config option overrides."""
    config: list[str | None] = [None, None, None]
    rest, it = [], iter(words)
    for word in it:
        flag, eq, value = word.partition("=")
        if flag in _CONFIG_OPTIONS:
            config[_CONFIG_OPTIONS[flag]] = value if eq else next(it, None)
        else:
            rest.append(word)
    return (config[0], config[1], config[2]), tuple(rest)


def _with_config(launch: Launch, words: Sequence[str], placeholders: Sequence[str] = ()) -> Launch:
    (name, path, directory), overrides = _split_config(words)
    texts = [t for t in (name, path, directory, *overrides) if t]
    unknowns = tuple(p for p in placeholders if any(p in t for t in texts))
    return replace(launch, config_name=name, config_path=path, config_dir=directory, overrides=overrides,
                   unknowns=unknowns)  # fmt: skip


class _TrainerReader(StaticShell):
    """The static shell, looking for the trainer command: each one found becomes a Launch."""

    TARGET = "the trainer"

    def __init__(self, path: Path, args: Sequence[str], env: Mapping[str, str]) -> None:
        super().__init__(path, args, env)
        self.trainers: list[Launch] = []

    def may_recognize(self, command: Node) -> bool:
        return b"-m" in (command.text or b"")

    def recognize(self, node: Node, words: list[str], loose: bool, prefix: list[Node], ctx: Taint, block) -> bool:
        if (found := self._match(words, loose)) is None:
            return False
        self._trainer(node, words, found, prefix, ctx, block)
        return True

    @staticmethod
    def _match(words: list[str], loose: bool) -> tuple[int, int] | None:
        """(index of the interpreter, index of the first trainer argument), or None."""
        for i, word in enumerate(words if words[:1] not in (["echo"], ["printf"]) else ()):
            if not (_PYTHON.fullmatch(word) or (loose and i == 0)):
                continue
            j = i + 1
            while j < len(words) and words[j].startswith("-") and not words[j].startswith(("-m", "-c")):
                j += 1  # interpreter flags such as -u
            if words[j : j + 2] == ["-m", TRAINER_MODULE]:
                return i, j + 2
            if words[j : j + 1] == ["-m" + TRAINER_MODULE]:
                return i, j + 1
        return None

    def _trainer(self, node: Node, words: list[str], found, prefix: list[Node], ctx: Taint, block) -> None:
        line = node_line(node)
        verdict, cond = decide(list(block.conds) if block is not None else self.conditions, "trainer")
        if verdict == NO and cond is not None:
            msg = f"the trainer command at line {line} never runs: it needs `{cond.text}` (line {cond.line}) to "
            self.unreached.append((line, msg + f"{'succeed' if cond.need else 'fail'}, and it never does"))
            return
        env = {n: scalar(v) for n, v in self.vars.items() if n in self.exported}
        for a in prefix:
            value = a.child_by_field_name("value")
            env[node_text(a.child_by_field_name("name"))] = join_pieces(self._pieces(value, ctx)) if value else ""
        if words[0] == "env":  # env A=1 python -m ...
            env |= dict(w.split("=", 1) for w in words[1 : found[0]] if NAME.match(w) and "=" in w)
        passthrough = tuple(self.args) if ctx.passthrough else ()
        variables = {k: scalar(v) for k, v in self.vars.items()}
        launch = Launch("", TRAINER_MODULE, None, (), passthrough, env, variables, (), line)
        self.trainers.append(_with_config(launch, words[found[1] :], list(self.placeholders)))
        self._required(ctx)
        for msg, at in ctx.unknown.items():
            self.report("warning", "unresolved", at, msg)
        for name, at, strict in ctx.unset:
            msg = f"positional argument ${name} is not given" if name.isdigit() else f"{name} is never set"
            msg += f" but is used without a default at line {at} ("
            msg += "set -u makes bash stop there" if strict else "it expands to nothing"
            msg += f"); write ${{{name}:-default}} or export {name} before running"
            self.report("error" if strict else "warning", "unset-variable", at, msg)
        for name, at, where in ctx.uncertain:
            msg = f"{name} is assigned inside {where} (line {at}), which preflight does not evaluate"
            if name in self.vars:
                self.report("warning", "unresolved", at, msg + ": the trainer may see another value")
            else:
                self.report("warning", "unresolved", at, msg + f", and not before it: the trainer gets <${name}>")
        if verdict == UNKNOWN and cond is not None:
            why = f" ({cond.why})" if cond.why else ": it is the status of a command that preflight does not run"
            msg = f"whether the trainer (line {line}) runs depends on `{cond.text}` (line {cond.line}), which "
            msg += f"preflight cannot evaluate{why}; it was read as if it runs. Make the condition one preflight "
            msg += "can evaluate (give the variables it reads with --env NAME=VALUE), or run the trainer outside it"
            self.report("error", "conditional", cond.line, msg)
        elif block is not None:
            msg = f"the trainer command is inside {block.what} (line {block.line}); it was read as if the block runs"
            self.report("warning", "unresolved", line, msg + ", with the variables as they are before it")
        for at, msg, guard in self.maybe_exits:
            if guard:  # the job fails visibly if it does: a check of the node, not a silent skip of the training
                msg += f"; if it does, the job fails there and the trainer (line {line}) does not run"
                self.report("warning", "guard", at, msg)
                continue
            msg += f"; if it does, the trainer (line {line}) never runs. Make the condition one preflight can "
            self.report("error", "conditional", at, msg + "evaluate (give the variables it reads with --env)")
        self._check_braces(ctx, words[found[1] :])
        self._check_tee(node)

    def _check_braces(self, ctx: Taint, overrides: list[str]) -> None:
        """A word that brace expansion turned into overrides of one key twice (``key={64,128}``)."""
        keys = [o.partition("=")[0].lstrip("+~") for o in overrides if "=" in o]
        for (at, text), fields in ctx.braced.items():
            twice = sorted({k for f in fields if (k := f.partition("=")[0].lstrip("+~")) and keys.count(k) > 1})
            if twice:
                msg = f"line {at}: bash's brace expansion makes {_short_words(fields)} of `{text}`, so the trainer "
                msg += f"gets {', '.join(twice)} more than once; quote the word ('{text}') to pass the braces "
                msg += "literally, or write a Hydra list (key=[a,b])"
                self.report("error", "brace-expansion", at, msg)

    def _check_tee(self, cmd: Node) -> None:
        """ "$@" given to a command piped from (or chained after) the trainer never reaches the trainer."""
        top, pipe = cmd, None
        while top.parent is not None and top.parent.type in CHAINS:
            top = top.parent
            pipe = pipe or (top if top.type == "pipeline" else None)
        scope, sib = [top], top.next_named_sibling
        while sib is not None and sib.start_point.row == cmd.end_point.row:
            scope, sib = [*scope, sib], sib.next_named_sibling
        for other in (c for s in scope for c in [s, *descendants(s, "command")] if c.type == "command"):
            piped = pipe is not None and pipe.start_byte <= other.start_byte < pipe.end_byte
            if other == cmd or not (piped or other.start_byte >= cmd.end_byte):
                continue
            for arg in other.children_by_field_name("argument"):
                if any(node_text(h) in ("@", "*") for h in descendants(arg, "special_variable_name")):
                    where = "before the pipe" if piped else "into the trainer command"
                    name = node_text(other.child_by_field_name("name") or other)
                    msg = f"{node_text(arg)} is passed to {name} (line {node_line(arg)}), not to the trainer: "
                    msg += f"move it {where}"
                    self.report("error", "args-to-tee", node_line(arg), msg)

    def launch(self, source: str, data: bytes) -> Launch:
        if not self.trainers and (self.unreached or self.exited):
            if self.unreached:
                at, msg = self.unreached[-1]
            else:
                at, text = self.exited or (None, "")
                msg = f"the script ends at line {at} (`{text}`) before any command runs the trainer"
                if (named := data.find(TRAINER_MODULE.encode())) >= 0:
                    msg += f" (it is named at line {data[:named].count(b'\n') + 1})"
            self.report("error", "not-reached", at, msg)
        elif not self.trainers:
            msg = f"no command in {source} runs `python -m {TRAINER_MODULE}` (searched python, python3, pythonX.Y, "
            msg += "/path/to/python and $PYTHON-style commands, sourced files and called functions)"
            if (at := data.find(TRAINER_MODULE.encode())) >= 0:
                msg += f"; it is named at line {data[:at].count(b'\n') + 1}, but not in a command that runs"
            self.report("error", "no-trainer", None, msg)
        elif len(self.trainers) > 1:
            lines, last = ", ".join(str(t.trainer_line) for t in self.trainers), self.trainers[-1].trainer_line
            msg = f"the trainer is started {len(self.trainers)} times (lines {lines}); preflight checks the last one"
            self.report("warning", "multiple-trainers", last, msg)
        if not self.trainers:  # a launch of no trainer still carries the script's variables for the report
            variables = {n: scalar(v) for n, v in self.vars.items()}
            env = {n: v for n, v in variables.items() if n in self.exported}
            self.trainers.append(Launch("", None, None, (), (), env, variables, (), None))
        return replace(self.trainers[-1], source=source, findings=tuple(dict.fromkeys(self.findings)))


def _short_words(words: Sequence[str], limit: int = 4) -> str:
    shown = " ".join(words[:limit])
    return shown + (f" ... ({len(words)} words)" if len(words) > limit else "")


def read_launch_script(path: str | Path, args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> Launch:
    """The trainer invocation of `bash PATH ARGS...` run with environment ENV (default: empty), read statically."""
    path = Path(path)
    try:
        data = read_script_file(path)
    except ScriptFileError as exc:
        raise LaunchError(f"cannot read launch script {path}: {exc}") from None
    shell = _TrainerReader(path, args, env or {})
    shell.run_file(path, data)
    return shell.launch(str(path), data)


def launch_from_overrides(overrides: Sequence[str]) -> Launch:
    """A Launch for a plain Hydra override list, as given after `python -m verl.trainer.main_ppo`."""
    return _with_config(Launch("<overrides>", TRAINER_MODULE, None, (), (), {}, {}, (), None), list(overrides))
