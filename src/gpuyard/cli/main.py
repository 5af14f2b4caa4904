"""Entry point of the `gpuyard` command: finds the noun modules, runs them, turns errors into one line."""

from __future__ import annotations

import importlib
import pkgutil
import sys
import traceback

import typer
from rich.console import Console
from rich.markup import escape

import gpuyard
from gpuyard.errors import GpuyardError
from gpuyard.exitcodes import exit_now

_app = typer.Typer(
    name="gpuyard",
    help="gpuyard: a GPU backend for AI (hardware, fabric, data, training, jobs, models, serving).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
err = Console(stderr=True, highlight=False)
_state = {"debug": False, "fast_exit": False}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gpuyard {gpuyard.__version__}")
        raise typer.Exit()


@_app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback when a command fails."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    _state["debug"] = debug


# Commands a module of another name registers; every other command is registered by the module of
# its name. Only a shortcut: a command not found where this says is looked for in every module.
_REGISTERED_BY = {"undeploy": "deploy", "deployments": "deploy", "cv": "tune"}
_registered: set[str] = set()
_module_of: dict[int, str] = {}  # a registered command's (or group's) module


def _command_modules() -> list[str]:
    """The modules of gpuyard.cli that may contribute commands, in the order they are registered."""
    import gpuyard.cli as pkg

    names = (m.name for m in pkgutil.iter_modules(pkg.__path__))
    return sorted(n for n in names if n != "main" and not n.startswith("_"))


def _register(name: str) -> None:
    """Add module ``name``'s commands to the app (through its register(app)), once."""
    if name in _registered:
        return
    _registered.add(name)
    register = getattr(importlib.import_module(f"gpuyard.cli.{name}"), "register", None)
    if register is None:
        return
    before = len(_app.registered_commands), len(_app.registered_groups)
    register(_app)
    for info in [*_app.registered_commands[before[0] :], *_app.registered_groups[before[1] :]]:
        _module_of[id(info)] = name


def _register_commands(args: list[str] | None = None) -> None:
    """Register the commands ``args`` runs: those of the module registering its command (the first
    word not an option) when it is found there, else every module's (help, a mistyped command), as
    the app always had them. A command then imports what it needs alone, not every other command's
    libraries (scheduler, fabric model, numpy: most of the CLI's start-up)."""
    args = list(args or ())
    at = next((i for i, a in enumerate(args) if not a.startswith("-")), len(args))
    command = args[at] if at < len(args) and "--help" not in args[:at] else None
    modules = _command_modules()
    if command is not None and (module := _REGISTERED_BY.get(command, command)) in modules:
        _register(module)
        known = {c.name for c in _app.registered_commands} | {g.name for g in _app.registered_groups}
        if command in known:
            return
    for module in modules:
        _register(module)
    # Listed (help) in the modules' order, as when every module is registered at once.
    _app.registered_commands.sort(key=lambda info: _module_of.get(id(info), "~"))
    _app.registered_groups.sort(key=lambda info: _module_of.get(id(info), "~"))


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; user errors print one line on stderr and exit 2 (a traceback with --debug)."""
    args = sys.argv[1:] if argv is None else argv
    _state["debug"] = "--debug" in args
    _register_commands(args)
    try:
        # Not standalone: click's usage errors come here, to be said in one line like ours.
        code = _app(args=args, prog_name="gpuyard", standalone_mode=False)
    except typer.Abort:  # Ctrl-C at a prompt or in a command
        err.print("interrupted")
        sys.exit(130)
    except typer.TyperException as exc:  # typer's (vendored click's) usage errors
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
            typer.echo(ctx.get_help())  # `gpuyard` or `gpuyard data` alone: the help, as before
            sys.exit(2)
        message = " ".join(exc.format_message().split()) if hasattr(exc, "format_message") else str(exc)
        where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        err.print(f"[red]error:[/red] {escape(message)}{where}", soft_wrap=True)
        sys.exit(getattr(exc, "exit_code", 2))
    except GpuyardError as exc:
        if _state["debug"]:
            traceback.print_exc()
        err.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    # As click's standalone mode: typer.Exit(code)'s code, else 0 (a bool a command returned is not one).
    code = code if type(code) is int else 0
    if _state["fast_exit"] and argv is None:
        # The process is this command alone (not a caller's main([...])) and it asked to skip the
        # interpreter's teardown of what it imported (torch: about 0.5 s).
        exit_now(code)
    sys.exit(code)


def fast_exit() -> None:
    """Let this command end its process without the interpreter's teardown (see :func:`main`)."""
    _state["fast_exit"] = True


def __getattr__(name: str) -> typer.Typer:
    # `from gpuyard.cli.main import app` (CliRunner in tests, docs tools): the app with every command.
    if name == "app":
        _register_commands()
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    # `python -m gpuyard.cli.main`: this module is also the one commands import as gpuyard.cli.main
    # (fast_exit() above is then this run's, as under the `gpuyard` script), not a second copy.
    sys.modules.setdefault("gpuyard.cli.main", sys.modules[__name__])
    main()
