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

app = typer.Typer(
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


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback when a command fails."),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    _state["debug"] = debug


def _register_commands() -> None:
    # Every module in gpuyard.cli but this one contributes its commands through register(app).
    import gpuyard.cli as pkg

    for mod in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if mod.name in ("main",) or mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"gpuyard.cli.{mod.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(app)


_register_commands()


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; user errors print one line on stderr and exit 2 (a traceback with --debug)."""
    args = sys.argv[1:] if argv is None else argv
    _state["debug"] = "--debug" in args
    try:
        # Not standalone: click's usage errors come here, to be said in one line like ours.
        code = app(args=args, prog_name="gpuyard", standalone_mode=False)
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


if __name__ == "__main__":
    main()
