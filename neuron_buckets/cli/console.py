"""The command line's two streams and its one way to stop with an error.

Results go to stdout (``out``) so ``--json`` output can be piped; logs, progress and errors go to
stderr (``err``). Every expected failure ends the same way: one ``error:`` line, exit status 2.
Both consoles print text as it is, never as rich markup: messages quote user input (paths,
prompts, config keys such as ``[cache]``), which markup would mangle or choke on. Styled output
is built from ``rich.text.Text``.
"""

from __future__ import annotations

import traceback

import click
import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperGroup

from neuron_buckets.utils.ascii_int import in_int64, parse_ascii_int
from neuron_buckets.utils.errors import UserError, brief

out = Console(markup=False)
err = Console(stderr=True, markup=False)


def fail(message: object, code: int = 2) -> typer.Exit:
    """Print one clear error line (never wrapped, never markup) and return the exit to raise."""
    line = " ".join(str(message).split()) or type(message).__name__
    err.print(Text.assemble(("error:", "bold red"), " ", line), highlight=False, soft_wrap=True)
    return typer.Exit(code)


EXPECTED = (UserError, ValueError, OSError)


def is_click_error(e: BaseException, *names: str) -> bool:
    """Whether ``e`` is one of click's exceptions ``names``, raised by click itself, by typer, or
    by the copy of click that newer typer releases carry."""
    return any(c.__name__ in names and c.__module__.endswith(".exceptions") for c in type(e).__mro__)


def is_click_flow(e: BaseException) -> bool:
    """click's own control flow (exit, help, abort): click prints and exits for those."""
    return is_click_error(e, "Exit", "ClickException", "Abort")


class ErrorHandlingGroup(TyperGroup):
    """The CLI's one error path: expected failures become one line, anything else is a bug."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            raise  # the reader left (nb ... | head): click's main exits without a word
        except EXPECTED as e:
            raise fail(e) from None
        except Exception as e:
            # a bad option value or a missing argument: one line too, not click's usage box
            if is_click_error(e, "UsageError") and not is_click_error(e, "NoArgsIsHelpError"):
                raise fail(e.format_message()) from None
            if is_click_flow(e):
                raise
            err.print(traceback.format_exc(), highlight=False, soft_wrap=True, end="")
            raise fail(f"unexpected {type(e).__name__}: this is a bug in nb; please report it with the "
                       "traceback above", code=1) from None


def int_list(option: str, text: str) -> list[int]:
    """'128,256,512' -> [128, 256, 512], or a ValueError naming the option and the bad field.

    Strict: every field is one ASCII integer within int64, so '1,,2', '１,２' or '1.5' are
    refused instead of being read as something else.
    """
    values = []
    for i, field in enumerate(text.split(","), 1):
        value = parse_ascii_int(field)
        if value is None or not in_int64(value):
            what = "is not an integer" if value is None else "is beyond int64"
            raise ValueError(f"{option}: expected comma-separated integers; field {i} {brief(field)} {what}")
        values.append(value)
    return values
