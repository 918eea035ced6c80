"""What every command does before any heavy work: quiet import warnings, one-line usage errors,
plain-text ``--help`` with defaults (:class:`HelpFormatter`, :func:`plain_text`).

Shared by ``megatron-branch`` (:mod:`megatron_branch.cli`) and the tools
(``tools/convert_checkpoint.py``). Output targets are checked with
:func:`megatron_branch.atomic.check_output_file` / ``check_output_dir``; each failure is a
``ValueError``/``OSError`` of one line naming the flag and the path, which
:func:`megatron_branch.distributed.run_main` reports with exit code 2. No torch import.
"""

from __future__ import annotations

import argparse
import re
import warnings
from typing import Any, Optional


def quiet_megatron_warnings() -> None:
    """Silence megatron-core's import-time warnings about the Apex/Transformer Engine
    fallbacks (expected on CPU), so a failure stays one line. Call before importing it."""
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", module="megatron.core.transformer.transformer_config")


# Sphinx roles (":func:`x`", ":class:`~a.B`", ":func:`title <target>`") and literals ("``x``"),
# which docstrings keep for the API docs but a terminal shows as clutter.
_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`~?([^`<]*?)\s*(?:<[^`>]*>)?`")
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)
_BOLD = re.compile(r"\*\*(.+?)\*\*", re.DOTALL)


def plain_text(doc: Optional[str]) -> str:
    """``doc`` (a reST docstring) as plain text for ``--help``: ":func:`x`" -> "x", "``x``" -> "x".

    Args:
        doc: a docstring; ``None`` gives ``""``.

    Returns:
        The text with Sphinx roles, inline literals and bold markers removed (their text kept;
        "~a.b.c" keeps "c", as Sphinx shows it).
    """
    if not doc:
        return ""

    def role(match: "re.Match[str]") -> str:
        text = match.group(1)
        return text.rsplit(".", 1)[-1] if match.group(0).split("`", 1)[1].startswith("~") else text

    return _BOLD.sub(r"\1", _LITERAL.sub(r"\1", _ROLE.sub(role, doc)))


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written (docstring paragraphs and lists), and every option's default.

    "(default: ...)" is added only where it says something: not for flags (``store_true``),
    not for ``None`` (a preset's value or "off", which the help text states itself) and not
    where the help already names its default.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default is None or action.default is False or "default" in help_text:
            return help_text
        return super()._get_help_string(action)


def preset_default(full: Any, quick: Any) -> str:
    """"(default: 3; --quick: 1)" for an option left ``None`` so that a preset supplies it.

    Args:
        full: the full preset's value (a list is shown space-separated, as it is typed).
        quick: the ``--quick`` preset's value; not shown when it is the same.
    """
    def show(value: Any) -> str:
        return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)

    same = show(full) == show(quick)
    return f"(default: {show(full)})" if same else f"(default: {show(full)}; --quick: {show(quick)})"


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit code 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
